"""Unit tier: no daemon process, no zmq; DaemonState and the codec driven directly."""

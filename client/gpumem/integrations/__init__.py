"""Adapters that put third-party engines on gpumemd with the engine's own code unchanged
(each patches the engine at named seams when enabled; importing one patches nothing)."""

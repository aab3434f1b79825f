from gpumemd.cli import main

main()

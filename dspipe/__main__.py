from dspipe.cli import main

main()

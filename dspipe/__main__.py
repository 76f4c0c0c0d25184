from dspipe.cli.app import main

main()

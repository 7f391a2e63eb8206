from chatd.cli.main import main

main()

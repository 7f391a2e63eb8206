from chatd.cli import main

main()

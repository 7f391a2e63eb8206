from chatd.tools.cli import main

main()

from poprun_py.cli.main import main

main()

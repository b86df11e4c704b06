from poprun_py.cli import main

main()

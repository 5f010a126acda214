from pkvbench.cli import main

main()

from dsec.edge.app import main

main()

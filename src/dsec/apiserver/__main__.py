from dsec.apiserver.app import main

main()

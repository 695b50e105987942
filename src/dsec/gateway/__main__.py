from dsec.gateway.app import main

main()

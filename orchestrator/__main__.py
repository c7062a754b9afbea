from egomem.orchestrator.app import main

main()

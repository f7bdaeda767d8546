from consumer_kit.cli.main import main

main()

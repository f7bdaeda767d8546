from consumer_kit.cli import main

main()

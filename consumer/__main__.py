from consumer.cli import main

main()

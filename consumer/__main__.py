from genqueue.consumer.cli import main

main()

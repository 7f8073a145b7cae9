from genqueue.producer.cli import main

main()

"""The taking of work: rq jobs in, held, renewed, and acked.

- intake.py: dequeue jobs of the served runs, check what they carry, hold them;
- packs.py: jobs by reference: an unreadable pack, a pack outage, the pack names kept;
- book.py: the book of held jobs, their waiting and in-flight items (pure);
- shares.py: how many waiting items each served run gets (pure);
- leases.py: renew what this consumer holds, sweep what dead consumers left;
- acker.py: the endings of held jobs (ack, send back, refuse, give back);
- settle.py: what a shard's fate (shipped, lost, its run gone) settles for the jobs held.

May import: genqueue.common, genqueue.consumer.rqthread, genqueue.consumer.rqcompat, genqueue.consumer.served, genqueue.consumer.guards, genqueue.consumer.answer
"""

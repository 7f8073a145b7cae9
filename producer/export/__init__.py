"""The export wing: `producer export` turns a run's shipped shards into the dataset a trainer
reads, and accounts for every item of the run (done, partial, failed, refused, missing).

- command.py / summary.py: the click command and its options; its progress bar and summary;
- core.py / plan.py: the Exporter running the phases in turn; what it writes and what it did;
- partition.py / parts.py / reduce.py / failedjobs.py / coverage.py: pass 1 into partition
  files, their record header, pass 2 (one record a key), failed jobs, the missing items;
- formats/: one module per --format (converters, Arrow schema, generation rows), a registry;
- records.py / genrows.py: a shard line read once; a conversation as one row per generation;
- parquet.py / sinks.py / layout.py / stage.py: where rows go, in the run's order, selected;
- card.py / cardsection.py: the dataset card beside the dataset;
- sources.py / tempnames.py: shards from a folder or S3; the hidden names of files in writing;
- parity.py / hf_render.py / parity_command.py: `producer parity`, the recorded prompt ids
  against the model's tokenizer and chat template;
- feature*.py / logprob*.py: `producer export-features` and `export-logprobs`, the captured
  rows joined by id to the tokens rows, in the files the trainers read.

May import: genqueue.common, genqueue.producer.outfiles, genqueue.producer.packitems, genqueue.producer.rungone, genqueue.producer.ingest.sources
"""

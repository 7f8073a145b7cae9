"""The export wing: `producer export` turns a run's shipped shards into the dataset a trainer
reads, and accounts for every item of the run (done, partial, failed, refused, missing).

- command.py: the click command, its options, and the summary it prints;
- core.py: the pass over the shards (dedupe by item key, outcomes kept or set aside);
- formats.py: the export formats (an enum) and their one registry: each format's converter,
  its errors-file line, whether it may be Parquet, its side file;
- records.py: one shard line read once into the contract's record and its placing fields;
- parquet.py / sinks.py / layout.py: where rows go (JSONL, Parquet partitions, side files);
- tempnames.py: the hidden names files are written under before they are renamed into place;
- coverage.py: the run's items against what the shards hold;
- sources.py: reading shards from a local folder or S3;
- parity.py / hf_render.py / parity_command.py: `producer parity`, the recorded prompt ids
  against the model's tokenizer and chat template.
- features.py / featurewriters.py / featurelayouts.py / featurescmd.py: `producer
  export-features`, the captured hidden states joined by id to the tokens rows, in the files
  speculators, SpecForge or `datasets` read.

May import: genqueue.common, genqueue.producer.outfiles, genqueue.producer.packitems, genqueue.producer.rungone, genqueue.producer.ingest.sources
"""

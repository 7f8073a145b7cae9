"""The drafter wing: `producer drafter-report` judges a candidate drafter from a run's records
alone (a run declared with `producer enqueue --drafter NAME`, a held-out slice served by engines
running the candidate), side by side with another run's (the previous drafter, or none).

- compare.py: the records of each run reduced to their answers, and the report (the acceptance
  table by category, both runs' figures and their difference), pure;
- reading.py: a run's records read from its output (a directory or s3://), or from the output
  its run in Redis names;
- command.py: the click command, its options, and the report's text.

Only producer/cli.py imports the wing (it registers command.py's drafter_report_command).

May import: genqueue.common
"""

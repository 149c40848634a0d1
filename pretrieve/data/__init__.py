"""Raw corpora -> shards -> streams -> batches (docs/design.md, "Data flow")."""

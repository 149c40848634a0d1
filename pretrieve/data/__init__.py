"""Raw corpora -> shards -> streams -> batches (see DESIGN.md "Data flow")."""

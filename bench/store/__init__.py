"""The results store: the row schema and its migrations, the writer, the readers and the Parquet cache."""

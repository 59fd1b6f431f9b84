"""The data plane: tables, row cache, miss engine, serving loop, hints, hot set, prewarm."""

"""One served model made of two engines: one generates, the other computes dense rows."""

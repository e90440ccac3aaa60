"""HTTP routes, one module per endpoint family; handlers stay thin."""

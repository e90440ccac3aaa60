"""Wire types: msgspec Structs mirroring OpenAI's API, validated once at decode."""

"""Tokens to text and back: tokenizers, incremental detokenisation, stop strings and
chat templates. Neither asyncio nor models live here."""

"""Structured output: grammars (JSON schema, regex, EBNF) that constrain what a request may
generate, compiled by llguidance against our tokenizer's byte vocabulary."""

"""Constrained decoding: output that a JSON schema, regex, choice list or grammar must accept.

``constraint`` says what a request asks for (hashable, with a digest), ``schema_check`` refuses
schemas we will not compile, ``compiler`` turns a constraint into an llguidance matcher (off the
caller's thread, bounded in time, cached by digest), ``matcher`` follows one request's tokens,
and ``masks`` computes a batch's allowed-token masks and applies them to the logits.
"""

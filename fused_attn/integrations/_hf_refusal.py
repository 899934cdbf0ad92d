"""`_refused`: the NotImplementedError every refusal of the transformers integration raises, naming the case."""


def _refused(what: str) -> NotImplementedError:
    return NotImplementedError(f"fused_attn (transformers): {what}")

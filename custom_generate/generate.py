"""hf_bole as a Hub `custom_generate` recipe: `model.generate(..., custom_generate="<repo>", trust_remote_code=True)`.

A thin shim: the decoding loop lives in the `hf_bole` package (see requirements.txt).
"""

import hf_bole


def generate(model, *args, **kwargs):
    """Tree speculative decoding with `model.generate`'s arguments; see `hf_bole.generate`."""
    return hf_bole.generate(model, *args, **kwargs)

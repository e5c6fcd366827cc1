"""attnkit: attention variants of large language models (MHA, MQA, GQA, MLA) on the CPU."""
from ._attnkit import *  # noqa: F401,F403

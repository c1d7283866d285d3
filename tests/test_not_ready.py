"""A call that reaches a service before its model is loaded is UNAVAILABLE (retry, or another replica);
one that reaches a service started without a model is FAILED_PRECONDITION.

Regression: the server listens before it is SERVING (health says NOT_SERVING while weights load), and a
round-robin channel sends calls to any connected replica. A restarted encoder replica answered those
calls FAILED_PRECONDITION ("serves no model"), which nothing retries, so requests failed while a
healthy replica stood beside it (tests/test_soak.py's restart).
"""

import asyncio

import pytest

from modalmesh import pb
from modalmesh.errors import FailedPrecondition, Unavailable
from modalmesh.metrics import Metrics
from modalmesh.service import build_parser
from modalmesh.testing import tiny


def _service(cls, argv):
    parser = build_parser(cls.name, cls.description, max_message_mb=cls.max_message_mb)
    cls.add_arguments(parser)
    return cls(parser.parse_args(argv), Metrics(cls.name, process_metrics=False))


def _cases():
    from services.llm.server import LLMService
    from services.vae.server import VAEDecoderService
    from services.vision_encoder.server import VisionEncoderService

    return [
        ("vision", VisionEncoderService, "qwen2_vl",
         lambda s: s.encode(pb.EncodeRequest(items=[pb.EncodeItem()]))),
        ("llm", LLMService, "qwen2", lambda s: s.generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]))).__anext__()),
        ("vae", VAEDecoderService, "vae", lambda s: s.decode(pb.DecodeRequest())),
    ]


@pytest.mark.parametrize("index", range(3), ids=["vision", "llm", "vae"])
def test_a_call_before_the_model_is_loaded_is_unavailable_and_without_a_model_failed_precondition(index, tmp_path):
    _, cls, family, call = _cases()[index]
    loading = _service(cls, ["--model", str(tiny.ensure(family, tmp_path)), "--device", "cpu"])
    with pytest.raises(Unavailable, match="still loading"):
        asyncio.run(call(loading))
    bare = _service(cls, ["--device", "cpu"])
    with pytest.raises(FailedPrecondition, match="--model DIR"):
        asyncio.run(call(bare))

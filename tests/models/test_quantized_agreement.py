"""The embedded GGUF served quantized (its Q4_1/Q8_0 blocks multiplied as blocks, through the
decode step) against its own dequantized fp32 run: teacher-forced top-1 agreement over 512
positions, mean absolute logit error reported. The GGUF's own quantization error is not ours;
only our kernels' numerics are."""

from __future__ import annotations

import logging

import pytest
import torch

from pdserve.api.sampling import SamplingParams
from pdserve.runner.paged_attention import PagedAttention
from pdserve.runner.model_runner import ModelRunner
from pdserve.engine.schedule_types import ScheduledChunk
from pdserve.kv.layout import KVPoolLayout
from pdserve.kv.specs import plan_groups
from pdserve.models.loader import load_model
from pdserve.models.quant.modules import QuantizedLinear

logger = logging.getLogger(__name__)

NUM_POSITIONS = 512
BLOCK_SIZE = 16
MIN_AGREEMENT = 0.98

PASSAGE = """
The harbour town woke slowly on winter mornings. Before the first ferry left, the baker on the
corner had already sold most of his rye loaves to fishermen who wanted something warm in their
pockets, and the woman who ran the newspaper kiosk was stacking yesterday's unsold papers into a
neat pile for the recycling van. Nobody hurried. The tide decided when the boats went out, and
the tide had never once been persuaded to change its mind.
The ferry itself was older than most of its passengers. Its engine coughed twice before it
caught, and the captain, a tall man with a grey beard and a surprisingly soft voice, liked to
say that the boat was simply clearing its throat before a long speech. The crossing took forty
minutes on a calm day and more than an hour when the wind came from the north. Children pressed
their faces to the salt-stained windows, counting the seals on the rocks near the lighthouse,
while their parents drank coffee from paper cups and talked about the price of heating oil.
On the island there was a school with eleven pupils, a post office that opened three days a
week, and a library housed in what used to be the harbour master's office. The librarian kept a
handwritten list of every book that had been borrowed since she arrived, and she could tell you,
without looking, that the most popular title of the last decade was a field guide to coastal
birds. Visitors sometimes asked whether she found the work lonely. She always answered that a
room full of books is never empty, and that the islanders came in more often than anyone on the
mainland would believe, especially in February, when the storms kept everyone indoors.
In spring the island changed. Walkers arrived with maps and heavy boots, a small cafe reopened
near the old chapel, and the farmers let their sheep out onto the hills above the western
cliffs. The school held its annual fair, where the older pupils sold jam, painted stones and
tickets for a raffle whose first prize was, every single year, a lobster dinner cooked by the
captain of the ferry. People joked that he entered the raffle himself in the hope of finally
eating one of his own dinners, but he insisted that he preferred to watch other people enjoy
them.
By autumn the visitors were gone again. The cafe closed, the chapel bell was taken down to be
repaired, and the evenings grew short and blue. The librarian began a new page in her list, the
baker changed to his winter recipes, and the ferry went on crossing the grey water twice a day,
coughing before every departure, as reliable as the tide that ruled it.
"""


def _runner(model) -> ModelRunner:
    spec = model.spec
    plan = plan_groups(spec.layer_specs)
    layout = KVPoolLayout(NUM_POSITIONS // BLOCK_SIZE + 2, plan.group_size, BLOCK_SIZE, spec.num_kv_heads,
                          spec.head_dim, torch.float32)
    return ModelRunner(model, plan, layout, torch.device("cpu"))


def _chunk(tokens: list[int], start: int, table: list[int]) -> ScheduledChunk:
    return ScheduledChunk("passage", tokens, start, (table,), sample=True, sampling=SamplingParams(max_tokens=1))


def _prefill(runner: ModelRunner, tokens: list[int], table: list[int]) -> torch.Tensor:
    """Logits of every position from one eager prefill, which also fills the pool's K/V."""
    chunk = _chunk(tokens, 0, table)
    model = runner.model
    with torch.inference_mode():
        attention = PagedAttention(runner.plan, runner.layer_caches, [chunk], BLOCK_SIZE, runner.device)
        return model.compute_logits(model(torch.tensor(tokens), torch.arange(len(tokens)), attention))


def _decode_logits(runner: ModelRunner, tokens: list[int], table: list[int]) -> torch.Tensor:
    """Teacher forcing through decode steps: once the prompt's K/V are in the pool, a step whose
    rows are positions p..p+n-1 of the passage gives each of them the logits decoding would.
    Steps of 1, 2, 3, ... rows cover every row tile of the kernels in few steps."""
    _prefill(runner, tokens, table)
    rows, position, num_rows = [], 0, 1
    with torch.inference_mode():
        while position < len(tokens):
            positions = range(position, min(position + num_rows, len(tokens)))
            rows.append(runner.decode_step.run([_chunk([tokens[p]], p, table) for p in positions]))
            position, num_rows = positions.stop, num_rows % 32 + 1
    return torch.cat(rows)


@pytest.mark.slow
def test_quantized_decode_agrees_with_the_dequantized_fp32_model(record_property):
    exact = load_model(None, torch.float32, torch.device("cpu"), quantization="none")
    quantized = load_model(None, torch.float32, torch.device("cpu"), quantization="gguf")
    assert isinstance(quantized.model.layers[0].mlp.down_proj, QuantizedLinear)
    assert isinstance(quantized.model.lm_head, QuantizedLinear)
    tokens = quantized.tokenizer.encode(" ".join(PASSAGE.split()), add_special_tokens=False)[:NUM_POSITIONS]
    assert len(tokens) == NUM_POSITIONS
    table = list(range(1, NUM_POSITIONS // BLOCK_SIZE + 1))
    reference = _prefill(_runner(exact.model), tokens, table)
    served = _decode_logits(_runner(quantized.model), tokens, table)
    agreement = (reference.argmax(-1) == served.argmax(-1)).float().mean().item()
    mean_abs_error = (reference - served).abs().mean().item()
    record_property("top1_agreement", agreement)
    record_property("mean_abs_logit_error", mean_abs_error)
    logger.warning("quantized vs dequantized fp32 over %d positions: top-1 agreement %.4f, mean |logit error| %.2e",
                   NUM_POSITIONS, agreement, mean_abs_error)
    assert agreement >= MIN_AGREEMENT, (agreement, mean_abs_error)

"""A tiny causal LM and tokenizer built on the spot (no hub download), and a scripted policy, for running TRL's
GRPOTrainer on CPU.

The tokenizer is a byte-level BPE trained here on a few lines, with the special tokens of TRL's own Qwen3 chat
template (which TRL knows how to parse tool calls from). The model is a real ``Qwen3ForCausalLM`` of a few
thousand parameters: its forward pass, loss, backward and optimizer step are TRL's and PyTorch's own.

``ScriptedPolicy.generate`` is the one test double: a random tiny model cannot write tool calls, so its sampling
is replaced by scripts (what a trained GPU model would write). Each script is a plan for one rollout of a task:
a list of turns, each turn a list of tool calls. The first turn of the ``g``-th identical prompt of a batch
follows plan ``g`` and says so ("Plan g."), which later turns read back from the conversation.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
from trl.chat_template_utils import qwen3_chat_template

Call = tuple[str, dict[str, Any]]  # a tool's name and arguments
Plan = Sequence[Sequence[Call]]  # turns of tool calls
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
    "</tool_response>", "<think>", "</think>",
]  # fmt: skip
_TASK = re.compile(r"\[task ([\w-]+)\]")
_PLAN = re.compile(r"Plan (\d+)\.")


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (every text encodes and decodes back exactly) with Qwen3's chat template."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = [qwen3_chat_template, '{"name": "bash", "arguments": {"command": "cat notes.txt"}}', "Plan 0. Done."]
    trainer = trainers.BpeTrainer(
        vocab_size=800, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=qwen3_chat_template
    )
    tokenizer.padding_side = "left"
    return tokenizer


class ScriptedPolicy(Qwen3ForCausalLM):  # type: ignore[misc]
    """A real tiny Qwen3 whose ``generate`` follows scripts (see the module docstring)."""

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
        tokenizer: PreTrainedTokenizerFast = self.tokenizer
        seen: dict[str, int] = {}
        rows = []
        for row in input_ids:
            text = tokenizer.decode(row, skip_special_tokens=False)
            self.contexts.append(text)
            task = _TASK.findall(text)[-1]
            turn = text.count("<|im_start|>assistant") - 1
            if turn == 0:
                plan = seen[text] = seen.get(text, -1) + 1
            else:
                plan = int(_PLAN.findall(text)[-1])
            reply = _reply(self.scripts[task], plan, turn)
            ids = tokenizer.encode(reply, add_special_tokens=False)
            rows.append(torch.cat([row, torch.tensor(ids, dtype=row.dtype)]))
        width = max(len(row) for row in rows)
        pad = int(tokenizer.pad_token_id)
        return torch.stack([torch.nn.functional.pad(row, (0, width - len(row)), value=pad) for row in rows])


def _reply(plans: Sequence[Plan], plan: int, turn: int) -> str:
    turns = plans[plan]
    if turn >= len(turns):
        return "Done.<|im_end|>"
    calls = "".join(
        f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
        for name, arguments in turns[turn]
    )
    head = f"Plan {plan}.\n" if turn == 0 else ""
    return f"{head}{calls}<|im_end|>"


def scripted_policy(tokenizer: PreTrainedTokenizerFast, scripts: Mapping[str, Sequence[Plan]]) -> ScriptedPolicy:
    """A few-thousand-parameter Qwen3 over ``tokenizer`` that follows ``scripts`` (task id -> plans)."""
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=8192, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = ScriptedPolicy(config)
    model.tokenizer = tokenizer
    model.scripts = dict(scripts)
    model.contexts = []  # every context it was asked to continue, decoded
    return model

"""The benchmark workloads, written once as a neutral description every engine is fed from.

W1 = N requests, each with its own 448x448 image, a prompt of 288 tokens once the image's
placeholder expands (256 image tokens on Qwen2.5-VL, 196 on Qwen3-VL: the text fills the
rest; where one image alone is longer, as LLaVA-NeXT's 2,928 and LLaVA-OneVision's 3,699
tiled tokens, the image plus 32 words), exactly 128 output tokens (EOS ignored). W2 = the same with output lengths uniform
in 16..512. A request is its raw prompt text (one placeholder per image), the same prompt
as token ids with one placeholder token per image (the form vLLM takes), the seeds of its
images, and its forced output length. Images are made from their seeds, so another
process (the vLLM peer) rebuilds exactly the same ones; `fingerprint` proves it.

The prompt text is single-token words after the placeholder, so its token ids are exact
whatever reads it: our adapter, the HF processor, a Parquet row through the job path.
Each engine's conversion lives with that engine: `bench.adapt.engine_prompts` (ours),
`bench.peers.hf.hf_inputs`, `bench.peers.vllm.vllm_requests`.
"""

from __future__ import annotations

import hashlib
import io
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

IMAGE_SIDE = 448
PROMPT_TOKENS = 288
W1_OUTPUT_TOKENS = 128
W2_OUTPUT_RANGE = (16, 512)
WORKLOADS = ("w1", "w2")
JPEG_QUALITY = 85
MIN_TEXT_TOKENS = 32  # words after an image that alone fills PROMPT_TOKENS

# Words to draw prompts from; those the tokenizer keeps as one token after a space are used.
_WORDS = (
    "the cat sits on mat and dog runs in park while a person is riding bicycle down street sun shining there are two "
    "people standing near water describe image one sentence what shown this picture photo shows red square white "
    "background small blue circle next green triangle how many objects video please answer question with short caption "
    "quick brown fox jumps over lazy you helpful assistant user asks color car yellow where book table test batch "
    "inference system vision language models count frames read text start end clip hello world tiny model"
).split()


def make_image(seed: int, side: int = IMAGE_SIDE) -> Image.Image:
    """A smooth colour field of its own per seed: distinct content, photo-like JPEG sizes."""
    rng = np.random.default_rng(seed)
    axis = np.linspace(0.0, 1.0, side, dtype=np.float32)
    x, y = np.meshgrid(axis, axis)
    channels = []
    for _ in range(3):
        a, b, c = rng.uniform(-120, 120, 2).tolist() + [rng.uniform(60, 190)]
        freq, phase = rng.uniform(1, 6), rng.uniform(0, 2 * np.pi)
        channels.append(c + a * x + b * y + 30 * np.sin(freq * (x + y) * np.pi + phase))
    return Image.fromarray(np.clip(np.stack(channels, axis=-1), 0, 255).astype(np.uint8))


def jpeg_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return buffer.getvalue()


@dataclass(frozen=True)
class Request:
    prompt: str  # raw prompt text, one placeholder per image
    prompt_token_ids: list[int]  # the same, one placeholder token per image
    image_seeds: list[int]
    output_tokens: int


@dataclass
class Workload:
    name: str
    image_side: int
    prompt_tokens: int  # each prompt's length once its placeholders expand
    requests: list[Request]
    _images: dict[int, list[Image.Image]] = field(default_factory=dict, repr=False, compare=False)

    def images(self, index: int) -> list[Image.Image]:
        """Request `index`'s images, made once per process (every engine here gets the same objects)."""
        if index not in self._images:
            self._images[index] = [make_image(seed, self.image_side) for seed in self.requests[index].image_seeds]
        return self._images[index]

    def head(self, count: int) -> Workload:
        """The first `count` requests (their images shared with this workload)."""
        return Workload(self.name, self.image_side, self.prompt_tokens, self.requests[:count], self._images)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests)

    def fingerprint(self) -> str:
        """A digest of every request: token ids, output length and image pixels."""
        digest = hashlib.sha256(f"{self.name}:{self.image_side}:{self.prompt_tokens}".encode())
        for index, request in enumerate(self.requests):
            digest.update(repr((request.prompt_token_ids, request.output_tokens)).encode())
            for image in self.images(index):
                digest.update(image.tobytes())
        return digest.hexdigest()

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "image_side": self.image_side, "prompt_tokens": self.prompt_tokens,
                "requests": [asdict(r) for r in self.requests]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Workload:
        return cls(data["name"], data["image_side"], data["prompt_tokens"], [Request(**r) for r in data["requests"]])


def output_lengths(name: str, count: int) -> list[int]:
    """W1: 128 each; W2: uniform in 16..512, the same sequence in every run."""
    if name == "w1":
        return [W1_OUTPUT_TOKENS] * count
    if name == "w2":
        rng = random.Random(0)
        return [rng.randint(*W2_OUTPUT_RANGE) for _ in range(count)]
    raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")


def prompt_words(tokenizer) -> list[str]:
    """The words of `_WORDS` that `tokenizer` keeps as one token after a space (and that are no special token)."""
    specials = set(tokenizer.all_special_ids)
    words = []
    for word in _WORDS:
        ids = tokenizer(" " + word, add_special_tokens=False)["input_ids"]
        if len(ids) == 1 and ids[0] not in specials and word not in words:
            words.append(word)
    if len(words) < 8:
        raise ValueError(f"the tokenizer keeps only {len(words)} benchmark words whole; prompts would repeat too much")
    return words


def image_prompt_tokens(adapter, image_side: int = IMAGE_SIDE) -> int:
    """Tokens of a prompt that is one `image_side`-square image's placeholder alone."""
    return adapter.check(adapter.image_placeholder, [Image.new("RGB", (image_side, image_side))])


def workload_prompt_tokens(adapter, image_side: int = IMAGE_SIDE, prompt_tokens: int = PROMPT_TOKENS) -> int:
    """A workload prompt's length on `adapter`'s model: `prompt_tokens` wherever the image
    leaves room for words, else the image plus `MIN_TEXT_TOKENS` words (LLaVA-NeXT's and
    OneVision's tiled 448x448 image alone is thousands of tokens)."""
    image = image_prompt_tokens(adapter, image_side)
    return prompt_tokens if image < prompt_tokens else image + MIN_TEXT_TOKENS


def build_workload(name: str, adapter, count: int, seed: int, image_side: int = IMAGE_SIDE,
                   prompt_tokens: int = PROMPT_TOKENS) -> Workload:
    """`count` requests of workload `name` for `adapter`'s model: distinct images (seeded by
    `seed`: use another seed for requests that must not share caches with these) and words."""
    rng = random.Random(seed)
    words = prompt_words(adapter.tokenizer)
    first_seed = seed * 1_000_003
    prompt_tokens = workload_prompt_tokens(adapter, image_side, prompt_tokens)
    text_tokens = prompt_tokens - image_prompt_tokens(adapter, image_side)
    requests = []
    for index, length in enumerate(output_lengths(name, count)):
        prompt = adapter.image_placeholder + "".join(" " + rng.choice(words) for _ in range(text_tokens))
        ids = adapter.tokenizer(prompt)["input_ids"]
        requests.append(Request(prompt, list(ids), [first_seed + index], length))
    workload = Workload(name, image_side, prompt_tokens, requests)
    expanded = adapter.check(requests[0].prompt, workload.images(0)) if requests else prompt_tokens
    if expanded != prompt_tokens:
        raise ValueError(f"{name} prompts are {expanded} tokens, not {prompt_tokens}: a word split into several tokens")
    return workload


def write_parquet(workload: Workload, path: Path) -> Path:
    """The workload as job rows: id, raw prompt, the image as JPEG bytes, max_tokens (EOS is
    ignored by the job's sampling)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if any(len(r.image_seeds) != 1 for r in workload.requests):
        raise ValueError("job rows carry one image each")
    table = pa.table({
        "id": [f"{workload.name}-{r.image_seeds[0]}" for r in workload.requests],
        "prompt": [r.prompt for r in workload.requests],
        "image": [jpeg_bytes(workload.images(i)[0]) for i in range(len(workload.requests))],
        "max_tokens": [r.output_tokens for r in workload.requests],
    })
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path

"""Invoice images with their fields drawn on them, and the 6-field schema to extract them with.

The `jobs/invoice-extraction` example, the structured-output tests and the extraction
benchmark share them. Everything is deterministic: the same seed gives the same invoice
(fields and pixels). Text is drawn with Pillow's built-in scalable font, so no font file
is needed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

CURRENCIES = ("USD", "EUR", "GBP")
_VENDORS = ("Acme Hardware", "Blue River Foods", "Northwind Supply", "Globex Office", "Initech Parts", "Umbrella Labs")
_ITEMS = ("steel bolts", "paint bucket", "paper reams", "coffee beans", "cable ties", "safety gloves", "desk lamp")

# Six required fields; strings bounded by patterns so even a random-weight model ends them.
INVOICE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "invoice_number": {"type": "string", "pattern": "^INV-[0-9]{4,6}$"},
        "vendor": {"type": "string", "pattern": "^[A-Za-z ]{1,24}$"},
        "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
        "currency": {"enum": list(CURRENCIES)},
        "total": {"type": "number", "minimum": 0, "maximum": 1000000},
        "paid": {"type": "boolean"},
    },
    "required": ["invoice_number", "vendor", "date", "currency", "total", "paid"],
    "additionalProperties": False,
}

INVOICE_PROMPT = "Extract the invoice number, vendor, date, currency, total and whether it is paid, as JSON."


def invoice_fields(seed: int) -> dict[str, Any]:
    """The ground truth of invoice `seed` (what a perfect model extracts), items included."""
    rng = np.random.default_rng(seed)
    items = [(str(rng.choice(_ITEMS)), int(rng.integers(1, 20)), round(float(rng.uniform(1, 200)), 2)) for _ in range(int(rng.integers(2, 5)))]
    return {
        "invoice_number": f"INV-{int(rng.integers(1000, 999999)):04d}",
        "vendor": str(rng.choice(_VENDORS)),
        "date": f"20{int(rng.integers(20, 27))}-{int(rng.integers(1, 13)):02d}-{int(rng.integers(1, 29)):02d}",
        "currency": str(rng.choice(CURRENCIES)),
        "total": round(sum(qty * price for _, qty, price in items), 2),
        "paid": bool(rng.integers(0, 2)),
        "items": items,
    }


def make_invoice(seed: int, width: int = 480, height: int = 360) -> Image.Image:
    """An RGB invoice: header, vendor, number, date, an item table, the total and its status."""
    fields = invoice_fields(seed)
    image = Image.new("RGB", (width, height), (250, 250, 246))
    draw = ImageDraw.Draw(image)
    title, body = ImageFont.load_default(size=26), ImageFont.load_default(size=15)
    draw.text((24, 18), "INVOICE", fill=(20, 40, 90), font=title)
    draw.text((24, 58), fields["vendor"], fill=(0, 0, 0), font=body)
    draw.text((width - 190, 24), f"No. {fields['invoice_number']}", fill=(0, 0, 0), font=body)
    draw.text((width - 190, 46), f"Date {fields['date']}", fill=(0, 0, 0), font=body)
    y = 100
    draw.line((24, y, width - 24, y), fill=(120, 120, 120), width=1)
    for name, qty, price in fields["items"]:
        y += 26
        draw.text((24, y), name, fill=(0, 0, 0), font=body)
        draw.text((width - 200, y), f"{qty} x {price:.2f}", fill=(0, 0, 0), font=body)
    y += 40
    draw.line((24, y, width - 24, y), fill=(120, 120, 120), width=1)
    draw.text((width - 200, y + 12), f"TOTAL {fields['total']:.2f} {fields['currency']}", fill=(0, 0, 0), font=body)
    draw.text((24, y + 12), "PAID" if fields["paid"] else "DUE", fill=(0, 120, 0) if fields["paid"] else (170, 0, 0), font=title)
    return image


def write_invoice_dataset(directory: str | Path, num_rows: int, first_seed: int = 0) -> Path:
    """`invoices.jsonl` (id, the question, the image, the expected total and vendor) beside
    `images/invoice-N.png`; image paths are relative to the JSONL file."""
    directory = Path(directory)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    path = directory / "invoices.jsonl"
    with path.open("w", encoding="utf-8") as out:
        for seed in range(first_seed, first_seed + num_rows):
            name = f"images/invoice-{seed}.png"
            make_invoice(seed).save(directory / name)
            fields = invoice_fields(seed)
            row = {
                "id": f"invoice-{seed}",
                "messages": [{"role": "user", "content": INVOICE_PROMPT}],
                "image": name,
                "expected_total": fields["total"],
                "expected_vendor": fields["vendor"],
            }
            out.write(json.dumps(row) + "\n")
    return path

"""Varied chat instructions built from local material, for self-distilling an EAGLE head.

The material is the Python standard library (functions' source, modules' docstrings) and the
word lists below. Training instructions and held-out instructions differ in both their kinds
(templates) and their material (stdlib modules and word lists split apart), so an evaluation on
the held-out set measures a head on prompts unlike any it was trained on.

    python scripts/chat_instructions.py --num-train 2000 --num-heldout 64   # prints a sample
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import random
import re
import textwrap
import warnings
from collections.abc import Callable
from dataclasses import dataclass

# ---- word lists (train) ---------------------------------------------------------------------
TOPICS = """photosynthesis; the water cycle; gravity; volcanoes; the printing press; electricity;
the immune system; black holes; plate tectonics; the French Revolution; compound interest;
recycling; the internet; vaccines; climate change; the Roman Empire; rainbows; magnets;
the stock market; sleep; earthquakes; the moon landing; inflation; democracy; DNA;
the Silk Road; solar panels; tides; the Renaissance; bees and pollination; coral reefs;
the Industrial Revolution; supply and demand; the speed of light; antibiotics; glaciers;
the Olympic Games; jazz music; origami; chess openings; the human heart; wind turbines;
the periodic table; caffeine; meditation; public libraries; time zones; the metric system;
hurricanes; the Great Wall of China""".replace("\n", " ").split("; ")
PLACES = """Paris; Tokyo; Kenya; Iceland; the Amazon rainforest; Canada; Egypt; Peru; Norway;
Australia; the Sahara desert; Venice; New York City; Mongolia; Scotland; Vietnam; Chile;
the Alps; Morocco; Greece; Singapore; Alaska; Portugal; Nepal""".replace("\n", " ").split("; ")
THINGS = """a bicycle; a refrigerator; a pencil; a smartphone; a lighthouse; a violin;
an umbrella; a microwave oven; a compass; a telescope; a kite; a sewing machine; a clock;
a bridge; a battery; a camera; a thermometer; a printer; a backpack; a candle""".replace(
    "\n", " "
).split("; ")
PROGRAMMING = """recursion; a hash table; a linked list; binary search; unit testing;
version control; a REST API; a race condition; garbage collection; a closure; a decorator;
list comprehensions; big-O notation; a regular expression; a database index; caching;
an exception; a virtual environment; a generator; type hints""".replace("\n", " ").split("; ")
CATEGORIES = """fruits that grow on trees; board games; programming languages; musical
instruments; famous scientists; rivers in Europe; kitchen tools; types of clouds; sports played
with a ball; vegetables rich in iron; ways to save energy at home; common houseplants""".replace(
    "\n", " "
).split("; ")
SENTENCES = [
    "the results was better then we expected, so the team decide to continue the project",
    "i dont think its a good idea to leave the door open when its raining outside",
    "our store will be close on monday because of the holiday, we apologize for any inconvenient",
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
    "Please send me the report by Friday so I can review it before the meeting next week.",
    "He have been working here for five years and he know every customer by name.",
    "Water boils at 100 degrees Celsius at sea level, but at lower temperatures on mountains.",
    "The library opens at nine in the morning and closes at eight in the evening.",
]
CODE_TASKS = """reverses a string; checks whether a number is prime; counts the vowels in a
string; returns the largest element of a list; merges two sorted lists; computes the factorial
of n; removes duplicates from a list while keeping order; converts Celsius to Fahrenheit;
checks whether a word is a palindrome; flattens a nested list; returns the n-th Fibonacci
number; counts how often each word occurs in a text; validates an email address with a regular
expression; reads a CSV file and returns its rows as dictionaries; computes the average of a
list of numbers""".replace("\n", " ").split("; ")

# ---- word lists (held out) ------------------------------------------------------------------
H_TOPICS = """the history of tea; migrating birds; northern lights; the invention of the
telephone; honey; the Moon's phases; fermentation; bridges that sway; paper money;
lightning""".replace("\n", " ").split("; ")
H_PAIRS = [("cats", "dogs"), ("trains", "planes"), ("coffee", "tea"), ("Python", "JavaScript"),
           ("renting", "buying a home"), ("e-books", "paper books"),
           ("cycling", "running")]  # fmt: skip
H_SITUATIONS = """starting to learn to cook; preparing for a job interview; moving to a new city;
keeping a small garden on a balcony; studying for an exam; running a first marathon; working
from home""".replace("\n", " ").split("; ")
H_PLACES = ["Lisbon", "Kyoto", "Cape Town", "Quebec City", "Edinburgh", "Buenos Aires"]


# ---- stdlib material ------------------------------------------------------------------------
def _words(text: str) -> list[str]:
    return text.split()


MODULES = _words("""string textwrap shlex json.decoder json.encoder collections functools itertools
heapq bisect calendar fractions statistics difflib fnmatch glob posixpath ntpath base64 csv
ipaddress random operator pprint copy getopt gettext quopri netrc mailbox dataclasses enum
numbers decimal zipfile tarfile configparser logging logging.handlers argparse optparse
email.utils email.message email.header urllib.parse urllib.request html html.parser colorsys
wave sched shutil tempfile secrets hmac keyword tokenize traceback warnings contextlib abc
graphlib inspect ast dis pickle pickletools shelve dbm sqlite3 queue threading subprocess
socket selectors asyncio.tasks asyncio.queues http.client http.cookies http.server
xml.dom.minidom xml.etree.ElementTree plistlib platform locale codecs unicodedata re
sre_parse typing weakref types tracemalloc timeit trace pdb cmd code codeop zipimport
importlib.util pkgutil runpy sysconfig gzip bz2 lzma zlib hashlib uuid datetime zoneinfo
mimetypes smtplib ftplib imaplib poplib webbrowser wsgiref.util wsgiref.headers
concurrent.futures multiprocessing.pool string.templatelib""")


def split_of(name: str) -> str:
    """'heldout' for about one name in five, by a hash of the name; else 'train'."""
    return "heldout" if hashlib.sha256(name.encode()).digest()[0] < 52 else "train"


def stdlib_material() -> dict[str, dict[str, list[str]]]:
    """Functions' source (short ones) and modules' prose paragraphs, by split."""
    with warnings.catch_warnings():  # deprecated modules and attributes, read all the same
        warnings.simplefilter("ignore")
        return _stdlib_material()


def _stdlib_material() -> dict[str, dict[str, list[str]]]:
    out = {s: {"functions": [], "paragraphs": []} for s in ("train", "heldout")}
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception:  # a module this Python lacks or cannot import here
            continue
        part = out[split_of(name)]
        for para in re.split(r"\n\s*\n", inspect.getdoc(mod) or ""):
            para = " ".join(para.split())
            if 120 <= len(para) <= 900 and not para.startswith((">>>", "-", "*")):
                part["paragraphs"].append(para)
        members = inspect.getmembers(mod, lambda o: inspect.isfunction(o) or inspect.isclass(o))
        for _, fn in members:
            if getattr(fn, "__module__", None) != mod.__name__ or fn.__name__.startswith("_"):
                continue
            doc = " ".join((inspect.getdoc(fn) or "").split("\n\n")[0].split())
            if 120 <= len(doc) <= 900:
                part["paragraphs"].append(doc)
            if inspect.isclass(fn):
                continue
            try:
                src = textwrap.dedent(inspect.getsource(fn))
            except (OSError, TypeError):
                continue
            if 150 <= len(src) <= 1100:
                part["functions"].append(src)
    return out


# ---- templates ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Kind:
    name: str
    make: Callable[[random.Random, dict[str, list[str]]], str]


def _pick(rng: random.Random, items: list[str]) -> str:
    return items[rng.randrange(len(items))]


def _code(rng: random.Random, m: dict[str, list[str]]) -> str:
    return _pick(rng, m["functions"]).rstrip()


def _para(rng: random.Random, m: dict[str, list[str]]) -> str:
    return _pick(rng, m["paragraphs"])


TRAIN_KINDS = [
    Kind("explain_code", lambda r, m: f"Explain what this Python function does.\n\n{_code(r, m)}"),
    Kind("code_steps", lambda r, m: f"Walk me through this code step by step:\n\n{_code(r, m)}"),
    Kind(
        "docstring",
        lambda r, m: (
            f"Write a docstring for this function and return the whole function.\n\n{_code(r, m)}"
        ),
    ),
    Kind("code_purpose", lambda r, m: f"In one sentence, what is this for?\n\n{_code(r, m)}"),
    Kind("write_code", lambda r, m: f"Write a Python function that {_pick(r, CODE_TASKS)}."),
    Kind(
        "code_test",
        lambda r, m: f"Write a short unit test for a Python function that {_pick(r, CODE_TASKS)}.",
    ),
    Kind("summarise", lambda r, m: f"Summarize this text in two sentences.\n\n{_para(r, m)}"),
    Kind("simplify", lambda r, m: f"Explain this paragraph in simple words:\n\n{_para(r, m)}"),
    Kind("key_terms", lambda r, m: f"List the technical terms used in this text.\n\n{_para(r, m)}"),
    Kind(
        "questions", lambda r, m: f"Write three questions that this text answers.\n\n{_para(r, m)}"
    ),
    Kind("what_is", lambda r, m: f"What is {_pick(r, TOPICS)}?"),
    Kind("why", lambda r, m: f"Why is {_pick(r, TOPICS)} important?"),
    Kind("child", lambda r, m: f"Explain {_pick(r, TOPICS)} to a ten-year-old."),
    Kind("facts_place", lambda r, m: f"Give me three interesting facts about {_pick(r, PLACES)}."),
    Kind("visit", lambda r, m: f"What should a tourist see in {_pick(r, PLACES)}?"),
    Kind("how_works", lambda r, m: f"How does {_pick(r, THINGS)} work?"),
    Kind("history_thing", lambda r, m: f"Tell me briefly about the history of {_pick(r, THINGS)}."),
    Kind("prog_concept", lambda r, m: f"What is {_pick(r, PROGRAMMING)} in programming?"),
    Kind("prog_example", lambda r, m: f"Show a short Python example of {_pick(r, PROGRAMMING)}."),
    Kind("list", lambda r, m: f"List five {_pick(r, CATEGORIES)}."),
    Kind(
        "fix_grammar",
        lambda r, m: f"Correct the grammar and spelling of this sentence: {_pick(r, SENTENCES)}",
    ),
    Kind("formal", lambda r, m: f"Rewrite this sentence in a formal tone: {_pick(r, SENTENCES)}"),
    Kind(
        "extract_numbers",
        lambda r, m: (
            f"Extract every number and what it refers to from this text: {_pick(r, SENTENCES)}"
        ),
    ),
    Kind(
        "one_word",
        lambda r, m: (
            f"Give a one-word title for a text about {_pick(r, TOPICS)}, then explain your choice."
        ),
    ),
]
HELDOUT_KINDS = [
    Kind("find_bug", lambda r, m: f"Is there a bug in this function? Explain.\n\n{_code(r, m)}"),
    Kind("tldr", lambda r, m: f"Give a TL;DR of this passage.\n\n{_para(r, m)}"),
    Kind(
        "compare",
        lambda r, m: "Compare {} and {}: what are the main differences?".format(
            *_pick(r, [f"{a}|{b}" for a, b in H_PAIRS]).split("|")
        ),
    ),
    Kind("advice", lambda r, m: f"I am {_pick(r, H_SITUATIONS)}. What advice can you give me?"),
    Kind(
        "email",
        lambda r, m: (
            "Write a short email to a colleague asking to move our meeting "
            f"about {_pick(r, H_TOPICS)} to next Tuesday."
        ),
    ),
    Kind("haiku", lambda r, m: f"Write a haiku about {_pick(r, H_TOPICS)}."),
    Kind("trip", lambda r, m: f"Plan a one-day trip to {_pick(r, H_PLACES)}."),
    Kind("pros_cons", lambda r, m: f"What are the pros and cons of {_pick(r, H_SITUATIONS)}?"),
    Kind(
        "story", lambda r, m: f"Write the opening paragraph of a story about {_pick(r, H_TOPICS)}."
    ),
]


STYLES = [
    "",
    "",
    "",
    " Answer briefly.",
    " Use a bulleted list.",
    " Keep it under 100 words.",
    " Give an example.",
    " Be precise.",
    " Answer in a friendly tone.",
]


def instructions(split: str, n: int, seed: int) -> list[dict[str, str]]:
    """``n`` distinct instructions of ``split`` ('train' or 'heldout'), kinds in turn:
    ``[{"kind", "content"}]``."""
    material = stdlib_material()[split]
    kinds = TRAIN_KINDS if split == "train" else HELDOUT_KINDS
    rng = random.Random(f"{split}:{seed}")
    seen: set[str] = set()
    out: list[dict[str, str]] = []
    for attempt in range(50 * n):
        kind = kinds[attempt % len(kinds)]
        content = kind.make(rng, material)
        if split == "train":
            content += _pick(rng, STYLES)
        if content not in seen:
            seen.add(content)
            out.append({"kind": kind.name, "content": content})
            if len(out) == n:
                break
    rng.shuffle(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-train", type=int, default=2000)
    ap.add_argument("--num-heldout", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    for split, n in (("train", a.num_train), ("heldout", a.num_heldout)):
        items = instructions(split, n, a.seed)
        kinds = sorted({i["kind"] for i in items})
        print(f"{split}: {len(items)} instructions of {len(kinds)} kinds")
        for item in items[:3]:
            print(f"  [{item['kind']}] {item['content'][:160]!r}")


if __name__ == "__main__":
    main()

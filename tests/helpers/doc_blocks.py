"""The fenced code blocks of a documentation page and the words of its shell lines, as
tests/test_readme.py and the llama.cpp newcomer-path test read them."""
import re
import shlex
from pathlib import Path

ENV_ASSIGNMENT = re.compile(r"[A-Z_][A-Z0-9_]*=")


def blocks(page: Path, lang: str) -> list[str]:
    """The bodies of the page's ```<lang> blocks, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```", page.read_text(), flags=re.S | re.M)


def command_words(line: str) -> tuple[dict[str, str], list[str]]:
    """A shell line as (its leading NAME=value assignments, the command's words), quotes removed."""
    words = shlex.split(line, comments=True)
    env = {}
    while words and ENV_ASSIGNMENT.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words

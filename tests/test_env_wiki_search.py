"""wiki-search: the generated wiki, the three tools, scripted tool-using episodes (right,
wrong, malformed, unknown tool, a tool error, out of turns) with hand-checked rewards, the
search index cache, local files, demonstrations and the LLM judge against local servers."""

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prime_rl.envs import DatasetUnavailable, Example, ModelReply, ToolCall, Turn

from helpers import free_port
from orchestrator.envs.wiki_search import (
    INDEX_META,
    SYSTEM_PROMPT,
    answer_matches,
    corpus_key,
    demonstration,
    generated_wiki,
    load_environment,
    pages_from_rows,
    read_section,
    search_pages,
    split_sections,
    view_sections,
)

TURN = Turn([1, 2], [3, 4], [-0.5, -0.25])
TOOL_NAMES = ["search_pages", "view_sections", "read_section"]


def call(name, arguments, call_id="call_0"):
    """A tool call; ``arguments`` as a dict (sent as JSON) or as raw text (maybe not JSON)."""
    return ToolCall(call_id, name, arguments if isinstance(arguments, str) else json.dumps(arguments))


def calls(*tool_calls, text=""):
    return ModelReply(text, "stop", TURN, tool_calls=tuple(tool_calls))


class ScriptedClient:
    """Replies with the scripted replies in order (text or ModelReply); records the messages
    and the tool schemas of every call."""

    def __init__(self, replies):
        self.replies, self.calls, self.tools = list(replies), [], []

    async def reply(self, messages, context, n=1, tools=None):
        self.calls.append([dict(m) for m in messages])
        self.tools.append(tools)
        reply = self.replies.pop(0)
        reply = ModelReply(reply, "stop", TURN) if isinstance(reply, str) else reply
        return [reply for _ in range(n)]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """The hub never answers in these tests, whatever the network does."""
    monkeypatch.setattr("prime_rl.envs.data.hub_unreachable", lambda hub_id: "offline (test)")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("wiki_cache")


@pytest.fixture(scope="module")
def env(cache):
    return load_environment(source="generated", cache_dir=str(cache))


def vorlia(env):
    """The generated question about Vorlia's capital (corpus seed 0: the page says
    "The capital of Vorlia is Tarn.")."""
    info = {"query": "Vorlia", "page_id": "vorlia", "section_id": "vorlia:geography", "corpus_seed": 0,
            "question": "What is the capital of Vorlia?"}
    prompt = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "What is the capital of Vorlia?"}]
    return Example(0, prompt, "Tarn", info, "wiki-search")


RIGHT_PATH = [
    calls(call("search_pages", {"query": "Vorlia"})),
    calls(call("view_sections", {"page_id": "vorlia"}, "call_1")),
    calls(call("read_section", {"section_id": "vorlia:geography"}, "call_2")),
]


def play(env, example, replies):
    client = ScriptedClient(replies)
    return asyncio.run(env.rollout(client, example)), client


def tool_messages(rollout):
    return [m["content"] for m in rollout.completion if m["role"] in ("tool", "user")]


# --------------------------------------------------------------------------- the generated wiki


def test_generated_wiki_is_small_regular_and_deterministic():
    pages, questions = generated_wiki(0)
    assert len(pages) == 48 and len(questions) == 144
    assert generated_wiki(0) == generated_wiki.__wrapped__(0)  # same seed, same wiki
    assert generated_wiki.__wrapped__(1)[0] != pages  # another corpus seed draws other facts
    vorlia_page = next(p for p in pages if p["id"] == "vorlia")
    assert vorlia_page["content"] == (
        "## Overview\nVorlia is a small country. Its people speak Ilmic.\n"
        "## History\nVorlia was founded in the year 820.\n"
        "## Geography\nThe capital of Vorlia is Tarn."
    )
    parsed = {p.id: p for p in pages_from_rows(list(pages), "generated")}
    for q in questions:
        page = parsed[q["info"]["page_id"]]
        assert len(page.sections) == 3 and len(q["answer"].split()) == 1
        holding = [s.id for s in page.sections if q["answer"].lower() in s.text.lower().rstrip(".").split()]
        assert holding == [q["info"]["section_id"]], q  # the answer is in exactly its section


def test_searching_a_name_finds_exactly_its_page(env):
    for q in generated_wiki(0)[1][::3]:
        page = env.wiki.pages[q["info"]["page_id"]]
        assert search_pages(q["info"]["query"], env.wiki) == f"{page.id} ({page.title})"


def test_split_is_seeded_and_disjoint(env, cache):
    train, evals = [e.prompt[-1]["content"] for e in env.dataset], [e.prompt[-1]["content"] for e in env.eval_dataset]
    assert (len(train), len(evals)) == (116, 28) and not set(train) & set(evals)
    assert env.dataset[0].prompt[0] == {"role": "system", "content": SYSTEM_PROMPT}
    other = load_environment(source="generated", cache_dir=str(cache), seed=1, num_train_examples=10, num_eval_examples=5)
    assert len(other.dataset) == 10 and len(other.eval_dataset) == 5
    assert [e.prompt for e in other.eval_dataset] != [e.prompt for e in env.eval_dataset[:5]]


# --------------------------------------------------------------------------- tools


def test_tools_outputs_and_errors(env):
    wiki = env.wiki
    assert search_pages("Vorlia", wiki) == "vorlia (Vorlia)"
    assert search_pages("zzyzx", wiki) == "No pages match 'zzyzx'."
    assert view_sections("vorlia", wiki) == "vorlia:overview (Overview)\nvorlia:history (History)\nvorlia:geography (Geography)"
    assert read_section("vorlia:geography", wiki) == "The capital of Vorlia is Tarn."
    for tool, arg, message in [
        (view_sections, "atlantis", "no page 'atlantis'; search_pages lists page ids"),
        (read_section, "vorlia", "section id 'vorlia' is not page_id:section; view_sections lists them"),
        (read_section, "vorlia:climate", "no section 'vorlia:climate'; view_sections('vorlia') lists them"),
        (search_pages, "  ", "the query is empty; give words to search for"),
    ]:
        with pytest.raises(ValueError, match=f"^{message.replace('(', '[(]').replace(')', '[)]')}$"):
            tool(arg, wiki)


def test_markdown_sections():
    content = "Lead text.\n# History\nOld.\n## Early life\nYoung.\n\n## History\nAgain.\n# Empty\n"
    sections = split_sections("p", content)
    assert [(s.id, s.title, s.text) for s in sections] == [
        ("p:intro", "Introduction", "Lead text."),
        ("p:history", "History", "Old."),
        ("p:early_life", "Early life", "Young."),
        ("p:history_2", "History", "Again."),
        ("p:empty", "Empty", ""),
    ]
    assert [s.id for s in split_sections("p", "# Only\ntext")] == ["p:only"]


# --------------------------------------------------------------------------- episodes


def test_correct_tool_using_episode(env):
    rollout, client = play(env, vorlia(env), [*RIGHT_PATH, "Tarn"])
    assert tool_messages(rollout) == [
        "vorlia (Vorlia)",  # the real BM25 search
        "vorlia:overview (Overview)\nvorlia:history (History)\nvorlia:geography (Geography)",
        "The capital of Vorlia is Tarn.",
    ]
    assert [m.get("tool_call_id") for m in rollout.completion if m["role"] == "tool"] == ["call_0", "call_1", "call_2"]
    assert rollout.completion[0]["tool_calls"][0]["function"] == {"name": "search_pages", "arguments": '{"query": "Vorlia"}'}
    # every model call is offered the three tools, their hidden `wiki` argument left out
    assert len(client.tools) == 4 and all([t["function"]["name"] for t in tools] == TOOL_NAMES for tools in client.tools)
    assert client.tools[0][0]["function"]["parameters"] == {
        "type": "object",
        "properties": {"query": {"type": "string", "description": "words to look for, e.g. a name."}},
        "required": ["query"],
    }
    assert rollout.stop_condition == "completed" and rollout.reward == 1.0
    assert rollout.metrics == {
        "correct_answer": 1.0, "total_tool_calls": 3.0, "made_tool_call": 1.0, "tool_errors": 0.0, "malformed_calls": 0.0,
        "search_pages_calls": 1.0, "search_pages_errors": 0.0, "view_sections_calls": 1.0, "view_sections_errors": 0.0,
        "read_section_calls": 1.0, "read_section_errors": 0.0, "turns": 4.0,
    }


@pytest.mark.parametrize(
    ("answer", "reward"),
    [("Tarn", 1.0), ("The capital of Vorlia is Tarn.", 1.0), ("tarn!", 1.0), ("Oslen", 0.0), ("Tarnish", 0.0), ("", 0.0)],
)
def test_final_answers(env, answer, reward):
    rollout, _ = play(env, vorlia(env), [*RIGHT_PATH, answer])
    assert rollout.reward == reward and rollout.metrics["correct_answer"] == reward


def test_answer_without_tools_still_scores(env):
    rollout, _ = play(env, vorlia(env), ["Tarn"])  # a lucky guess is an answer like any other
    assert rollout.reward == 1.0 and rollout.metrics["total_tool_calls"] == 0.0 and rollout.num_turns == 1


def test_malformed_tool_calls(env):
    rollout, _ = play(env, vorlia(env), [
        calls(call("search_pages", '{"query": "Vorlia"')),  # arguments are not valid JSON
        '<tool_call>\n{"name": "search_pages", "arguments": {"query": \n</tool_call>',  # nothing parsable
        *RIGHT_PATH,
        "Tarn",
    ])
    said = tool_messages(rollout)
    assert said[0].startswith("Error: the arguments of search_pages are not a JSON object (")
    assert said[0].endswith('): {"query": "Vorlia"')
    assert said[1].startswith("Error: your reply contains <tool_call> but no tool call could be parsed")
    assert said[2:] == ["vorlia (Vorlia)", view_sections("vorlia", env.wiki), "The capital of Vorlia is Tarn."]
    assert rollout.reward == 1.0 and rollout.stop_condition == "completed"
    m = rollout.metrics
    assert (m["malformed_calls"], m["total_tool_calls"], m["tool_errors"], m["search_pages_errors"], m["turns"]) == (2, 4, 1, 1, 6)


def test_unknown_tool_and_hidden_argument(env):
    rollout, _ = play(env, vorlia(env), [
        calls(call("delete_page", {"page_id": "vorlia"}), call("search_pages", {"query": "Vorlia", "wiki": "mine"}, "call_1")),
        "I do not know.",
    ])
    assert tool_messages(rollout) == [
        "Error: unknown tool 'delete_page'; the tools are: search_pages, view_sections, read_section",
        "Error: search_pages takes no argument(s) ['wiki']",
    ]
    m = rollout.metrics
    assert (m["total_tool_calls"], m["tool_errors"], m["search_pages_errors"], m["correct_answer"]) == (2, 2, 1, 0)
    assert rollout.reward == 0.0


def test_tool_that_raises_returns_the_error(env):
    rollout, _ = play(env, vorlia(env), [
        calls(call("view_sections", {"page_id": "atlantis"})),
        calls(call("read_section", {"section_id": "vorlia:climate"})),
        calls(call("read_section", {"section_id": "vorlia:geography"})),
        "Tarn",
    ])
    assert tool_messages(rollout) == [
        "Error: no page 'atlantis'; search_pages lists page ids",
        "Error: no section 'vorlia:climate'; view_sections('vorlia') lists them",
        "The capital of Vorlia is Tarn.",
    ]
    m = rollout.metrics
    assert (m["view_sections_errors"], m["read_section_errors"], m["read_section_calls"], m["tool_errors"]) == (1, 1, 2, 2)
    assert rollout.reward == 1.0


def test_running_out_of_turns_scores_zero(cache):
    short = load_environment(source="generated", cache_dir=str(cache), max_turns=3)
    rollout, client = play(short, vorlia(short), [*RIGHT_PATH[:2], calls(call("read_section", {"section_id": "vorlia:geography"}), text="Tarn")])
    # the third turn is a tool call (its text says Tarn): no final answer, no tool run
    assert rollout.stop_condition == "max_turns" and rollout.num_turns == 3 and len(client.calls) == 3
    assert rollout.completion[-1]["role"] == "assistant" and rollout.reward == 0.0


@pytest.mark.parametrize(
    ("answer", "reference", "expected"),
    [
        ("Tarn", "Tarn", True),
        ("  the TARN. ", "Tarn", True),
        ("It is Tarn, I think.", "Tarn", True),
        ("Tarnish", "Tarn", False),
        ("Oslen", "Tarn", False),
        ("It was founded in 820", "820", True),
        ("8200", "820", False),
        ("Battle of the Vorlia Plains", "The Battle of Vorlia Plains", True),  # articles dropped on both sides
        ("Tarn Oslen Brix Elsk Fobb Jask Kovel Lunt Nesk Orrin Pask Quell", "Tarn", False),  # a list of guesses
        ("", "Tarn", False),
        (None, "Tarn", False),
        ("Tarn", "", False),
    ],
)
def test_answer_matching(answer, reference, expected):
    assert answer_matches(answer, reference) is expected


# --------------------------------------------------------------------------- index cache


def folders(root):
    return sorted(p.name for p in root.iterdir())


def test_index_cache_reused_and_keyed_by_corpus(tmp_path):
    first = load_environment(source="generated", cache_dir=str(tmp_path))
    assert first.wiki.index_built and folders(tmp_path) == [corpus_key(list(first.wiki.pages.values()))]
    assert (tmp_path / folders(tmp_path)[0] / INDEX_META).is_file()
    again = load_environment(source="generated", cache_dir=str(tmp_path))
    assert not again.wiki.index_built and search_pages("Vorlia", again.wiki) == "vorlia (Vorlia)"
    other = load_environment(source="generated", cache_dir=str(tmp_path), corpus_seed=1)  # another corpus
    assert other.wiki.index_built and len(folders(tmp_path)) == 2  # no temporary folder left either


def test_index_cache_changed_local_corpus_rebuilds(tmp_path):
    corpus, questions = write_local(tmp_path)
    args = dict(corpus_path=str(corpus), questions_path=str(questions), cache_dir=str(tmp_path / "cache"))
    assert load_environment(**args).wiki.index_built
    assert not load_environment(**args).wiki.index_built
    rows = [json.loads(line) for line in corpus.read_text().splitlines()]
    rows[0]["content"] += "\nMore text."
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    changed = load_environment(**args)
    assert changed.wiki.index_built and len(folders(tmp_path / "cache")) == 2
    assert read_section("kelp:growth", changed.wiki) == "Kelp grows fast in cold water.\nMore text."


@pytest.mark.parametrize("damage", ["garbage vocab", "no marker", "truncated data"])
def test_corrupt_or_partial_cache_is_rebuilt(tmp_path, capsys, damage):
    load_environment(source="generated", cache_dir=str(tmp_path))
    folder = tmp_path / folders(tmp_path)[0]
    if damage == "garbage vocab":
        (folder / "vocab.index.json").write_text("{not json")
    elif damage == "no marker":
        (folder / INDEX_META).unlink()
    else:
        data = folder / "data.csc.index.npy"
        data.write_bytes(data.read_bytes()[:20])
    rebuilt = load_environment(source="generated", cache_dir=str(tmp_path))
    assert rebuilt.wiki.index_built and search_pages("Vorlia", rebuilt.wiki) == "vorlia (Vorlia)"
    assert "is unreadable" in capsys.readouterr().err and folders(tmp_path) == [folder.name]
    assert not load_environment(source="generated", cache_dir=str(tmp_path)).wiki.index_built


def test_cache_location_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("PRIME_RL_CACHE", str(tmp_path / "prc"))
    load_environment(source="generated")
    assert len(folders(tmp_path / "prc" / "wiki_search")) == 1
    monkeypatch.delenv("PRIME_RL_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    load_environment(source="generated")
    assert len(folders(tmp_path / "home" / ".cache" / "prime-rl" / "wiki_search")) == 1


def test_unwritable_cache_still_searches(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    env = load_environment(source="generated", cache_dir=str(blocker))
    assert env.wiki.index_built and search_pages("Vorlia", env.wiki) == "vorlia (Vorlia)"
    assert "cannot cache the search index" in capsys.readouterr().err


# --------------------------------------------------------------------------- local files and sources


def write_local(folder):
    pages = [
        {"id": "kelp", "title": "Kelp", "content": "Kelp is a large seaweed.\n# Growth\nKelp grows fast in cold water."},
        {"id": "coral", "title": "Coral", "content": "# Reefs\nCoral reefs are built by polyps.\n# Threats\nWarm water bleaches coral."},
        {"id": "squid", "title": "Squid", "content": "# Body\nA squid has ten arms."},
    ]
    questions = [
        {"question": "How many arms does a squid have?", "answer": "ten",
         "info": {"query": "squid", "page_id": "squid", "section_id": "squid:body"}},
        {"question": "What builds coral reefs?", "answer": "polyps"},
        {"question": "What bleaches coral?", "answer": "warm water"},
        {"question": "Where does kelp grow fast?", "answer": "cold water"},
    ]
    corpus, qs = folder / "corpus.jsonl", folder / "questions.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in pages))
    qs.write_text("".join(json.dumps(r) + "\n" for r in questions))
    return corpus, qs


def test_local_corpus_and_questions(tmp_path):
    corpus, questions = write_local(tmp_path)
    env = load_environment(corpus_path=str(corpus), questions_path=str(questions), num_eval_examples=1, cache_dir=str(tmp_path / "c"))
    assert env.data_origin == "local files" and len(env.dataset) == 3 and len(env.eval_dataset) == 1
    assert view_sections("kelp", env.wiki) == "kelp:intro (Introduction)\nkelp:growth (Growth)"
    assert search_pages("warm water", env.wiki).splitlines()[0] == "coral (Coral)"
    squid = next(e for e in [*env.dataset, *env.eval_dataset] if e.answer == "ten")
    demo = demonstration(squid, env)
    assert [m["content"] for m in demo if m["role"] == "tool"] == ["squid (Squid)", "squid:body (Body)", "A squid has ten arms."]
    assert demonstration(next(e for e in env.dataset if e.answer == "polyps"), env) is None  # no path in info


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"corpus_path": "missing.jsonl"}, "corpus_path '.*missing.jsonl' does not exist"),
        ({"questions_path": None}, "corpus_path and questions_path go together"),
        ({"source": "hub"}, "local files, but source is 'hub'"),
        ({"corpus_rows": [{"id": "a", "title": "A"}]}, "corpus_path .* row 0 needs string `id`"),
        ({"corpus_rows": [{"id": "a", "title": "A", "content": ""}] * 2}, "row 1: page id 'a' is used twice"),
        ({"question_rows": [{"question": "Q?"}]}, "questions_path .* row 0 needs a non-empty `question` and `answer`"),
    ],
)
def test_local_file_errors(tmp_path, change, message):
    corpus, questions = write_local(tmp_path)
    if "corpus_rows" in change:
        corpus.write_text("".join(json.dumps(r) + "\n" for r in change.pop("corpus_rows")))
    if "question_rows" in change:
        questions.write_text("".join(json.dumps(r) + "\n" for r in change.pop("question_rows")))
    if change.get("corpus_path"):
        change["corpus_path"] = str(tmp_path / change["corpus_path"])
    args = {"corpus_path": str(corpus), "questions_path": str(questions), "cache_dir": str(tmp_path / "c"), **change}
    with pytest.raises((ValueError, DatasetUnavailable), match=message):
        load_environment(**args)


def test_hub_offline(cache):
    with pytest.raises(DatasetUnavailable, match="rare-wiki-pages is unreachable .*source='generated', or corpus_path"):
        load_environment(source="hub")
    env = load_environment(cache_dir=str(cache))  # auto: the generated wiki
    assert env.data_origin.startswith("generated offline") and len(env.dataset) == 116


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"source": "web"}, "source must be 'auto', 'hub', 'local' or 'generated', got 'web'"),
        ({"source": "local"}, "source='local' needs corpus_path and questions_path"),
        ({"top_k": 0}, "top_k must be an integer >= 1"),
        ({"max_turns": 0}, "max_turns must be an integer >= 1"),
        ({"num_eval_examples": 144}, "144 questions, not more than num_eval_examples=144"),
        ({"num_train_examples": 0}, "num_train_examples must be an integer >= 1 or -1"),
        ({"seed": "1"}, "seed must be an integer"),
        ({"judge_timeout_s": 0}, "judge_timeout_s must be a number > 0, got 0"),
        ({"num_examples": 5, "num_train_examples": 6}, "num_examples is another name"),
    ],
)
def test_argument_errors(cache, args, message):
    with pytest.raises(ValueError, match=message):
        load_environment(**{"source": "generated", "cache_dir": str(cache), **args})


# --------------------------------------------------------------------------- demonstrations


def test_demonstration_is_the_right_path(env):
    demo = demonstration(vorlia(env), env)
    assert demo[2:] == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "search_pages", "arguments": '{"query": "Vorlia"}'}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "vorlia (Vorlia)"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "view_sections", "arguments": '{"page_id": "vorlia"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": view_sections("vorlia", env.wiki)},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_2", "type": "function", "function": {"name": "read_section", "arguments": '{"section_id": "vorlia:geography"}'}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "The capital of Vorlia is Tarn."},
        {"role": "assistant", "content": "Tarn"},
    ]
    assert demonstration(vorlia(env)) == demo  # without the env: the generated wiki of info's corpus seed


def test_every_demonstration_replays_to_reward_one(env):
    """Played back through the environment, each demonstration's assistant turns get the
    same tool messages and the answer scores 1: SFT data and RL agree."""
    examples = [*env.dataset, *env.eval_dataset]
    for example in examples[::4]:
        demo = demonstration(example, env)
        replies = [
            calls(*(call(c["function"]["name"], c["function"]["arguments"], c["id"]) for c in m.get("tool_calls", [])),
                  text=m["content"])
            for m in demo[len(example.prompt):] if m["role"] == "assistant"
        ]
        rollout, _ = play(env, example, replies)
        assert rollout.completion == demo[len(example.prompt):] and rollout.reward == 1.0
    assert all(demonstration(e, env) is not None for e in examples)


# --------------------------------------------------------------------------- the LLM judge


class JudgeServer:
    """A local OpenAI-compatible server: the first path segment picks the behaviour
    (`yes`, `no`, `maybe`: that verdict; `fail`: HTTP 500; `hang`: no reply until released)."""

    def __init__(self):
        self.requests, self.release = [], threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append((self.path, self.headers.get("Authorization"), body))
                mode = self.path.strip("/").split("/")[0]
                if mode == "hang":
                    server.release.wait(20)
                    return
                if mode == "fail":
                    self.send_response(500)
                    self.end_headers()
                    return
                verdict = {"yes": "Yes.", "no": "no", "maybe": "I cannot tell."}[mode]
                data = json.dumps({"choices": [{"message": {"role": "assistant", "content": verdict}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()  # shutdown() waits one poll

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def judge_server():
    server = JudgeServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def endpoints(judge_server, tmp_path_factory):
    path = tmp_path_factory.mktemp("endpoints") / "endpoints.toml"
    urls = {mode: f"http://127.0.0.1:{judge_server.port}/{mode}/v1" for mode in ("yes", "no", "maybe", "fail", "hang")}
    urls["down"] = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    path.write_text("".join(
        f'[[endpoint]]\nendpoint_id = "{mode}"\nmodel = "judge-{mode}"\nurl = "{url}"\nkey = "WIKI_JUDGE_TEST_KEY"\n\n'
        for mode, url in urls.items()
    ))
    return path


def judged(cache, endpoints, judge, **args):
    return load_environment(source="generated", cache_dir=str(cache), judge=judge, endpoints_path=str(endpoints), **args)


def test_judge_yes_and_no(cache, endpoints, judge_server, monkeypatch):
    monkeypatch.setenv("WIKI_JUDGE_TEST_KEY", "sekret")
    yes = judged(cache, endpoints, "yes")
    rollout, _ = play(yes, vorlia(yes), [*RIGHT_PATH, "It is Tarn."])
    assert rollout.reward == 1.0 and rollout.metrics["correct_answer"] == 1.0 and rollout.metrics["judge_errors"] == 0.0
    path, auth, body = judge_server.requests[-1]
    assert path == "/yes/v1/chat/completions" and auth == "Bearer sekret" and body["model"] == "judge-yes"
    prompt = body["messages"][0]["content"]
    assert "What is the capital of Vorlia?" in prompt and "```\nTarn\n```" in prompt and "```\nIt is Tarn.\n```" in prompt
    no = judged(cache, endpoints, "no")
    rollout, _ = play(no, vorlia(no), ["Tarn"])  # the judge decides, even against the matcher
    assert rollout.reward == 0.0 and rollout.metrics["judge_errors"] == 0.0


def test_judge_not_asked_without_a_final_answer(cache, endpoints, judge_server):
    env = judged(cache, endpoints, "yes", max_turns=1)
    before = len(judge_server.requests)
    rollout, _ = play(env, vorlia(env), RIGHT_PATH[:1])
    assert rollout.reward == 0.0 and rollout.metrics["judge_errors"] == 0.0 and len(judge_server.requests) == before


@pytest.mark.parametrize("judge", ["fail", "hang", "maybe", "down"])
def test_failing_judge_scores_zero_counted_and_bounded(cache, endpoints, judge, capsys):
    env = judged(cache, endpoints, judge, judge_timeout_s=0.5)
    start = time.monotonic()
    rollout, _ = play(env, vorlia(env), ["Tarn"])
    assert time.monotonic() - start < 3.0  # a hanging judge is cut at judge_timeout_s
    assert rollout.reward == 0.0 and rollout.metrics["judge_errors"] == 1.0 and rollout.errors == ()
    assert f"judge {judge!r} failed" in capsys.readouterr().err


def test_judge_argument_errors(cache, endpoints, tmp_path):
    with pytest.raises(ValueError, match="judge 'gpt-9' is not an endpoint of .*it has \\['down', 'fail'"):
        judged(cache, endpoints, "gpt-9")
    with pytest.raises(ValueError, match="judge 'yes': endpoints file .* not found"):
        judged(cache, tmp_path / "none.toml", "yes")


def test_demonstration_of_a_file_question_needs_the_env(tmp_path):
    corpus, questions = write_local(tmp_path)
    env = load_environment(corpus_path=str(corpus), questions_path=str(questions), num_eval_examples=1, cache_dir=str(tmp_path / "c"))
    squid = next(e for e in [*env.dataset, *env.eval_dataset] if e.answer == "ten")
    with pytest.raises(ValueError, match="without env= needs a generated question"):
        demonstration(squid)

"""The distillation teacher without a server: config and placement, the sequences the teacher
scores (context distillation swaps the first prompt), the scoring of a step's samples, and
the parsing of vLLM's prompt logprobs. The real server: tests/test_inflight_vllm.py; the
trio with a teacher process: tests/test_trio.py (its kill-and-resume run carries a teacher)."""

import asyncio

import numpy as np
import pytest
from prime_rl.config import RLConfig
from prime_rl.launch.deployment import PlacementError, plan_single_node, process_specs
from prime_rl.envs import Rollout, Turn
from prime_rl.launch.deployment import rl_bindings
from prime_rl.settings import ConfigError
from prime_rl.launch.resolve import placed, resolve
from pydantic import ValidationError

from orchestrator.batch import ScoredRollout, pack_batches
from orchestrator.client import InferenceError
from orchestrator.client.parse import parse_prompt_logprobs, parse_prompt_top_k
from orchestrator.sampler import with_system_prompt
from orchestrator.teacher import Teacher, teacher_sequence
from prime_rl.config import TeacherClientConfig
from prime_rl.wire import teacher_array, teacher_top_arrays

def distill() -> dict:
    return {"trainer": {"loss": {"distill": {"reward_weight": 0.5}}}}  # fresh: validation fills it in place


def rl(**sections) -> RLConfig:
    return RLConfig.model_validate({"model": "Qwen/Qwen3-0.6B", "batch_size": 64, **distill(), **sections})


# --------------------------------------------------------------------------- config and placement


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"teacher": {"model": "t"}}, r"`\[teacher\]` is set but `\[trainer.loss.distill\]` is not"),
        (distill(), r"trainer.loss.distill is set but there is no `\[teacher\]`"),
        ({**distill(), "teacher": {}}, "set exactly one of `model`"),
        ({**distill(), "teacher": {"model": "t", "endpoint": "e"}}, "set exactly one of `model`"),
        ({**distill(), "teacher": {"model": "t", "system_prompt": "a", "system_prompt_file": "f"}}, "not both"),
        ({"trainer": {"loss": {"distill": {"kl_weight": 0}}}, "teacher": {"model": "t"}}, "nothing would be learned"),
        ({**distill(), "teacher": {"endpoint": "e", "placement": "trainer"}}, r'placement = "trainer" loads `model` in the trainer'),
        ({**distill(), "teacher": {"model": "t", "placement": "gpu"}}, r"placement\n.*'server' or 'trainer'"),
    ],
)
def test_a_teacher_and_the_distillation_loss_come_together(data, message):
    with pytest.raises(ValidationError, match=message):
        RLConfig.model_validate({"model": "m", **data})


def test_a_local_teacher_is_served_on_its_own_port_and_gpus(tmp_path):
    cfg = resolve(rl(teacher={"model": "teacher-model", "port": 8123}, deployment={"inference_gpus": 2, "trainer_gpus": 1}))
    assert cfg.orchestrator.teacher.client.base_url == "http://127.0.0.1:8123"
    assert cfg.orchestrator.teacher.model == "teacher-model" and cfg.orchestrator.teacher.system_prompt is None
    placement = plan_single_node(cfg, gpus_available=4)
    assert placement.teacher.gpus == (3,) and placement.teacher.port == 8123
    specs = {s.name: s for s in process_specs(placed(cfg, placement), tmp_path, placement)}
    teacher = specs["teacher"]
    assert teacher.env["CUDA_VISIBLE_DEVICES"] == "3" and not teacher.required  # a server, like inference
    assert teacher.tmp_dir_env == "TMPDIR"  # a vLLM server: its sockets in a directory of its own
    served = (tmp_path / "configs" / "teacher.json").read_text()
    assert '"model": "teacher-model"' in served and '"port": 8123' in served and '"seq_len": 513' in served
    assert ("127.0.0.1", 8123) in {(b.host, b.port) for b in rl_bindings(cfg, placement)}
    with pytest.raises(PlacementError, match=r"needs 4 GPUs \(inference_gpus 2 \+ trainer_gpus 1 \+ teacher_gpus 1\)"):
        plan_single_node(cfg, gpus_available=3)


def test_a_teacher_placed_in_the_trainer_starts_no_server_and_sends_nothing_on_the_wire(tmp_path):
    """`placement = "trainer"`: the trainer gets the teacher's folder, the orchestrator no
    teacher to ask, the launcher no server to start, and no GPUs go to one; a trainer config
    with a teacher and no distillation loss is refused."""
    cfg = resolve(rl(teacher={"model": "teacher-model", "placement": "trainer"}, deployment={"inference_gpus": 2, "trainer_gpus": 1}))
    assert cfg.trainer.teacher_model == "teacher-model" and cfg.orchestrator.teacher is None
    placement = plan_single_node(cfg, gpus_available=3)
    assert placement.teacher is None
    assert "teacher" not in {s.name for s in process_specs(placed(cfg, placement), tmp_path, placement)}
    served = resolve(rl(teacher={"model": "teacher-model"}))
    assert served.trainer.teacher_model is None and served.orchestrator.teacher.model == "teacher-model"
    # context distillation: the orchestrator renders the teacher's prompts, the trainer scores them
    context = resolve(rl(teacher={"model": "teacher-model", "placement": "trainer", "system_prompt": "Reverse it."}))
    assert context.orchestrator.teacher_system_prompt == "Reverse it." and context.orchestrator.teacher is None
    assert served.orchestrator.teacher_system_prompt is None
    with pytest.raises(ValidationError, match="teacher_system_prompt is for a teacher in the trainer"):
        served.orchestrator.model_validate({**served.orchestrator.model_dump(), "teacher_system_prompt": "x"})
    from prime_rl.config import TrainerConfig

    with pytest.raises(ValidationError, match="teacher_model is set but loss.distill is not"):
        TrainerConfig(teacher_model="t")


def test_top_k_reaches_the_orchestrator_the_teachers_server_and_the_frame_cap(tmp_path):
    from prime_rl.launch.resolve import with_transport
    from prime_rl.launch.teacher import teacher_inference

    plain = rl(teacher={"model": "t"}, seq_len=2048)
    cfg = rl(teacher={"model": "t"}, seq_len=2048, trainer={"loss": {"distill": {"reward_weight": 0.5, "top_k": 64}}})
    assert resolve(plain).orchestrator.teacher.top_k == 0 and teacher_inference(plain).max_logprobs == 20
    assert resolve(cfg).orchestrator.teacher.top_k == 64 and teacher_inference(cfg).max_logprobs == 64
    assert cfg.inference.max_logprobs == 20  # the policy's server is left as it is
    # 128 samples (2 a rollout) of 2048 tokens: 3.4 MB alone (the 64 MiB floor), 138 MB with 64 tokens at each
    assert with_transport(plain).orchestrator.transport.max_message_bytes == 64 * 2**20
    assert with_transport(cfg).orchestrator.transport.max_message_bytes > 137_000_000
    with pytest.raises(ValidationError, match="top_k"):
        rl(teacher={"model": "t"}, trainer={"loss": {"distill": {"top_k": -1}}})


def test_an_endpoint_teacher_is_looked_up_and_its_key_stays_a_variable_name(tmp_path):
    endpoints = tmp_path / "endpoints.toml"
    endpoints.write_text('[[endpoint]]\nendpoint_id = "big"\nmodel = "org/big"\nurl = "http://10.0.0.1:8000/v1"\nkey = "BIG_KEY"\n')
    cfg = resolve(rl(teacher={"endpoint": "big", "endpoints_path": str(endpoints)}))
    teacher = cfg.orchestrator.teacher
    assert (teacher.client.base_url, teacher.model, teacher.api_key_env) == ("http://10.0.0.1:8000", "org/big", "BIG_KEY")
    assert teacher.client.api_key is None and plan_single_node(cfg, 0).teacher is None  # nothing to start
    with pytest.raises(ConfigError, match=r"no endpoint 'small' in .*known: big"):
        resolve(rl(teacher={"endpoint": "small", "endpoints_path": str(endpoints)}))


def test_the_teachers_system_prompt_file_is_read_at_launch(tmp_path):
    prompt = tmp_path / "best_prompt.txt"
    prompt.write_text("Reverse the text, character by character.\n")
    cfg = resolve(rl(teacher={"model": "t", "system_prompt_file": str(prompt)}))
    assert cfg.orchestrator.teacher.system_prompt == "Reverse the text, character by character."
    with pytest.raises(ConfigError, match=r"teacher.system_prompt_file: '.*missing.txt' not found"):
        resolve(rl(teacher={"model": "t", "system_prompt_file": str(tmp_path / "missing.txt")}))
    with pytest.raises(ConfigError, match=r"^teacher.system_prompt_file: '/proc/self/environ' lies under /proc"):
        resolve(rl(teacher={"model": "t", "system_prompt_file": "/proc/self/environ"}))  # the process's secrets


# --------------------------------------------------------------------------- what the teacher scores


def test_the_teacher_scores_the_students_ids_or_its_own_first_prompt():
    plain = [Turn([1, 2], [3, 4], [-0.1, -0.2])]
    assert teacher_sequence(plain, np.array([1, 2, 3, 4])) == ([1, 2, 3, 4], 0)
    context = [Turn([1, 2], [3, 4], [-0.1, -0.2], teacher_prompt_ids=[9, 9, 9, 1, 2]), Turn([5], [6], [-0.3])]
    assert teacher_sequence(context, np.array([1, 2, 3, 4, 5, 6])) == ([9, 9, 9, 1, 2, 3, 4, 5, 6], 3)


def test_the_teachers_system_prompt_replaces_the_conversations_own():
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert with_system_prompt(chat, "T") == [{"role": "system", "content": "T"}, {"role": "user", "content": "u"}]
    assert with_system_prompt(chat[1:], "T") == [{"role": "system", "content": "T"}, {"role": "user", "content": "u"}]


class ScriptedTeacher:
    """Prompt logprobs of -0.01 * (position + 1), and the sequences it was asked for."""

    def __init__(self):
        self.asked = []

    async def prompt_logprobs(self, prompts):
        answers = []
        for ids in prompts:
            self.asked.append(list(ids))
            out = -0.01 * (np.arange(len(ids), dtype=np.float32) + 1)
            out[0] = 0
            answers.append(out)
        return answers


    async def prompt_top_logprobs(self, prompts, k):
        """As prompt_logprobs, with top-k ids 100 * position + j and logprobs -position - j."""
        out = []
        for ids, logprobs in zip(prompts, await self.prompt_logprobs(prompts)):
            positions = np.arange(len(ids))[:, None]
            top_ids = (100 * positions + np.arange(k)).astype(np.int32)
            top_logprobs = (-positions - np.arange(k)).astype(np.float32)
            top_ids[0], top_logprobs[0] = 0, 0
            out.append((logprobs, top_ids, top_logprobs))
        return out


def scored_teacher(items, seq_len=64, top_k=0):
    teacher = Teacher(TeacherClientConfig(model="t", top_k=top_k))
    asyncio.run(teacher.close())
    teacher.client = ScriptedTeacher()
    return asyncio.run(teacher.score(items, seq_len)), teacher.client.asked


def test_every_sampled_token_gets_the_teachers_logprob_at_its_own_position():
    # one plain rollout, one whose teacher prompt is 2 tokens longer (context distillation)
    plain = Rollout(0, [Turn([1, 2], [3, 4], [-0.5, -0.25])], 1.0)
    context = Rollout(1, [Turn([1, 2], [3], [-0.125], teacher_prompt_ids=[7, 7, 1, 2])], 0.0)
    items = [ScoredRollout(plain, 0.5, 0), ScoredRollout(context, -0.5, 0)]
    (scored, row), asked = scored_teacher(items)
    assert asked == [[1, 2, 3, 4], [7, 7, 1, 2, 3]]
    (a,), (b,) = (item.teacher_logprobs for item in scored)
    np.testing.assert_allclose(a, [0, 0, -0.03, -0.04])  # positions 2 and 3 of the same ids
    np.testing.assert_allclose(b, [0, 0, -0.05])  # position 2 of the student = 4 of the teacher's
    # reverse KL: mean of student - teacher over the three sampled tokens
    assert row["distill/reverse_kl"] == pytest.approx(((-0.5 + 0.03) + (-0.25 + 0.04) + (-0.125 + 0.05)) / 3)
    assert row["distill/teacher_tokens_per_s"] > 0
    (batch,) = pack_batches(scored, step=0, num_ranks=1, micro_batch_size=8, temperature=1.0, seq_len=64)
    np.testing.assert_allclose(teacher_array(batch.micro_batches[0].samples[0]), a)


def test_with_the_teacher_in_the_trainer_a_sample_carries_the_teachers_first_prompt_instead():
    """Context distillation, `placement = "trainer"`: nothing scored here, so the sample takes
    the teacher's rendering of its first prompt along (the trainer's teacher scores it); a
    later turn's prompt is the student's, and a cut that leaves no sampled token sends none."""
    from prime_rl.wire import teacher_view

    context = Rollout(1, [Turn([1, 2], [3], [-0.125], teacher_prompt_ids=[7, 7, 1, 2]), Turn([4], [5], [-0.5])], 0.0)
    (batch,) = pack_batches([ScoredRollout(context, -0.5, 0)], step=0, num_ranks=1, micro_batch_size=8, temperature=1.0, seq_len=64)
    (sample,) = batch.micro_batches[0].samples
    assert teacher_array(sample) is None
    assert teacher_view(sample)[0].tolist() == [7, 7, 1, 2, 3, 4, 5] and teacher_view(sample)[1] == 2
    (cut,) = pack_batches([ScoredRollout(context, -0.5, 0)], step=0, num_ranks=1, micro_batch_size=8, temperature=1.0,
                          seq_len=2)[0].micro_batches[0].samples
    assert cut.teacher_prompt_ids is None  # only the prompt is left: nothing for a teacher to score


def test_a_rollout_of_two_samples_gets_two_teacher_arrays_and_seq_len_cuts_them():
    turns = [Turn([1], [2, 3], [-0.1, -0.1]), Turn([4, 5], [6], [-0.1], restart=True)]
    (scored, _), asked = scored_teacher([ScoredRollout(Rollout(0, turns, 1.0), 1.0, 0)], seq_len=2)
    assert asked == [[1, 2], [4, 5]]
    first, second = scored[0].teacher_logprobs
    np.testing.assert_allclose(first, [0, -0.02])
    np.testing.assert_allclose(second, [0, 0])  # the cut left no sampled token


def test_with_top_k_every_sampled_token_gets_the_teachers_top_k_at_its_own_position():
    plain = Rollout(0, [Turn([1, 2], [3, 4], [-0.5, -0.25])], 1.0)
    context = Rollout(1, [Turn([1, 2], [3], [-0.125], teacher_prompt_ids=[7, 7, 1, 2])], 0.0)
    (scored, _), _ = scored_teacher([ScoredRollout(plain, 0.5, 0), ScoredRollout(context, -0.5, 0)], top_k=2)
    ((a_ids, a_lps),), ((b_ids, b_lps),) = (item.teacher_top for item in scored)
    assert a_ids.tolist() == [[200, 201], [300, 301]] and a_lps.tolist() == [[-2, -3], [-3, -4]]  # positions 2, 3
    assert b_ids.tolist() == [[400, 401]] and b_lps.tolist() == [[-4, -5]]  # student position 2 = teacher's 4
    (batch,) = pack_batches(scored, step=0, num_ranks=1, micro_batch_size=8, temperature=1.0, seq_len=64)
    first = batch.micro_batches[0].samples[0]
    assert first.teacher_top_k == 2 and teacher_top_arrays(first)[0].tolist() == [[200, 201], [300, 301]]
    (unasked, _), _ = scored_teacher([ScoredRollout(plain, 0.5, 0)])
    assert unasked[0].teacher_top is None


def test_top_k_rows_stop_where_seq_len_cuts_the_sample():
    rollout = Rollout(0, [Turn([1], [2, 3, 4], [-0.1, -0.1, -0.1])], 1.0)
    (scored, _), asked = scored_teacher([ScoredRollout(rollout, 1.0, 0)], seq_len=3, top_k=1)
    assert asked == [[1, 2, 3]]
    ((ids, _),) = scored[0].teacher_top
    assert ids.tolist() == [[100], [200]]  # tokens 2 and 3; token 4 lies past the cut
    (batch,) = pack_batches(scored, step=0, num_ranks=1, micro_batch_size=8, temperature=1.0, seq_len=3)
    assert teacher_top_arrays(batch.micro_batches[0].samples[0])[0].shape == (2, 1)


# --------------------------------------------------------------------------- vLLM's prompt logprobs


def test_prompt_top_k_is_the_k_most_likely_of_each_position_whatever_the_prompt_token():
    # position 1: the prompt's own token 5 ranks 3rd, outside the top 2 vLLM lists beside it
    choice = {"prompt_logprobs": [None, {"5": {"logprob": -3.0, "rank": 3}, "9": {"logprob": -0.2, "rank": 1},
                                         "4": {"logprob": -1.0, "rank": 2}},
                                  {"7": {"logprob": -0.5, "rank": 1}, "2": {"logprob": -1.5, "rank": 2}}]}
    ids, logprobs = parse_prompt_top_k(choice, [1, 5, 7], 2, "u")
    assert ids.dtype == np.int32 and logprobs.dtype == np.float32
    assert ids.tolist() == [[0, 0], [9, 4], [7, 2]]
    np.testing.assert_allclose(logprobs, [[0, 0], [-0.2, -1.0], [-0.5, -1.5]])
    with pytest.raises(InferenceError, match="^u: 2 of the 3 most likely tokens at prompt position 2$"):
        parse_prompt_top_k(choice, [1, 5, 7], 3, "u")
    with pytest.raises(InferenceError, match="no prompt logprobs for each of the 3 prompt tokens"):
        parse_prompt_top_k({"prompt_logprobs": [None]}, [1, 5, 7], 2, "u")


def test_a_teacher_that_cannot_return_k_tokens_is_refused_before_the_first_step():
    from orchestrator.teacher import TeacherError

    class Refusing(ScriptedTeacher):
        base_url = "http://t"
        config = TeacherClientConfig(model="t").client

        async def wait_healthy(self, timeout):
            pass

        async def tokenize(self, text):
            return [ord(c) for c in text], 512

        async def prompt_top_logprobs(self, prompts, k):
            raise InferenceError("POST http://t/v1/completions: 400 requested prompt logprobs of 30, more than max logprobs 20")

    class Tokenizer:
        def apply_chat_template(self, chat, tokenize=False):
            raise ValueError("no template")

        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    teacher = Teacher(TeacherClientConfig(model="t", top_k=30))
    asyncio.run(teacher.close())
    teacher.client, teacher.url = Refusing(), "http://t"
    with pytest.raises(TeacherError, match=r"^teacher at http://t: cannot return its 30 most likely tokens a position "
                                           r"\(trainer.loss.distill.top_k\): .*max logprobs 20; a vLLM server needs "
                                           r"--max-logprobs >= 30 \(a local teacher gets it\)$"):
        asyncio.run(teacher.check(Tokenizer(), 64))
    teacher.top_k = 0
    asyncio.run(teacher.check(Tokenizer(), 64))  # without top-k the same server serves


def test_prompt_logprobs_are_read_by_token_id():
    choice = {"prompt_logprobs": [None, {"5": {"logprob": -1.5, "rank": 2}, "9": {"logprob": -0.2, "rank": 1}},
                                  {"7": {"logprob": -0.5, "rank": 1}}]}
    np.testing.assert_allclose(parse_prompt_logprobs(choice, [1, 5, 7], "u"), [0, -1.5, -0.5])
    with pytest.raises(InferenceError, match="carries no prompt_logprobs: a teacher must be a vLLM server"):
        parse_prompt_logprobs({"text": "x"}, [1, 5], "u")
    with pytest.raises(InferenceError, match="2 prompt logprobs for a prompt of 3 tokens"):
        parse_prompt_logprobs({"prompt_logprobs": [None, {}]}, [1, 5, 7], "u")
    with pytest.raises(InferenceError, match="no finite prompt logprob for token 7 at position 2"):
        parse_prompt_logprobs({"prompt_logprobs": [None, {"5": {"logprob": -1}}, {"8": {"logprob": -1}}]}, [1, 5, 7], "u")


def test_a_teacher_that_does_not_answer_is_one_line():
    from helpers import free_port
    from prime_rl.config import ClientConfig

    from orchestrator.teacher import TeacherError

    url = f"http://127.0.0.1:{free_port()}"
    teacher = Teacher(TeacherClientConfig(model="t", client=ClientConfig(base_url=url, startup_timeout_s=1)))

    async def go():
        try:
            await teacher.check(None, 64)
        finally:
            await teacher.close()

    with pytest.raises(TeacherError, match=rf"^teacher at {url}: not reachable \(inference server at {url}/health not healthy after 1 s"):
        asyncio.run(go())

import asyncio
import textwrap

import pytest

from tidal.broker.types import PromptRow
from tidal.rollout.config import TaskConfig
from tidal.rollout.rewards import (
    call_reward,
    exact_match,
    load_reward_fn,
    math_verify_score,
    overlong_penalty,
    score_in_worker,
)
from tidal.rollout.tasks.char_tokenizer import build_char_tokenizer
from tidal.rollout.tasks.gsm8k import CustomTask


@pytest.mark.parametrize(
    ("length", "expected"),
    # max 20, buffer 4, factor 1: free up to 16 tokens, then -1/4 per token, -1 at 20 and beyond
    [(10, 0.0), (16, 0.0), (17, -0.25), (18, -0.5), (19, -0.75), (20, -1.0), (22, -1.5)],
)
def test_overlong_penalty_is_dapos_linear_buffer(length, expected):
    assert overlong_penalty(length, 20, 4, 1.0) == pytest.approx(expected)


def test_overlong_penalty_scales_by_factor_and_is_off_without_a_buffer():
    assert overlong_penalty(18, 20, 4, 0.5) == pytest.approx(-0.25)
    assert overlong_penalty(20, 20, 0, 1.0) == 0.0
    with pytest.raises(ValueError, match="task.overlong_buffer <= rollout.sampling.max_new_tokens"):
        overlong_penalty(3, 4, 8, 1.0)


def test_exact_match_ignores_surrounding_whitespace_only():
    assert exact_match("arithmetic", " 52\n", "52") == 1.0
    assert exact_match("arithmetic", "5 2", "52") == 0.0
    assert exact_match("arithmetic", "", "52") == 0.0


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),
        ("so the answer is \\boxed{72}", "72", 1.0),
        ("#### 71", "72", 0.0),
        ("earlier 72, then #### 70", "72", 0.0),  # the text after #### is the answer
        ("#### 1,000", "1000", 1.0),
        ("#### 3/4", "0.75", 1.0),
        ("I don't know", "72", 0.0),
    ],
)
def test_math_verify_score(response, truth, expected):
    assert math_verify_score("openai/gsm8k", response, truth) == expected


def test_math_verify_rejects_an_unparsable_ground_truth():
    with pytest.raises(ValueError, match="cannot parse the ground truth"):
        math_verify_score("openai/gsm8k", "#### 1", "no answer here")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            import asyncio

            def length_reward(data_source, solution_str, ground_truth, extra_info):
                return {"score": len(solution_str) / 10, "chars": len(solution_str)}

            async def async_match(data_source, solution_str, ground_truth, extra_info):
                await asyncio.sleep(0)
                return solution_str == ground_truth

            def returns_text(data_source, solution_str, ground_truth, extra_info):
                return "1.0"

            NOT_CALLABLE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_a_user_reward_loads_by_module_or_file_path_sync_or_async(user_module):
    sync_fn = load_reward_fn("my_rewards:length_reward")
    from_file = load_reward_fn(f"{user_module / 'my_rewards.py'}:async_match")
    assert asyncio.run(call_reward(sync_fn, "d", "abcd", None, {})) == (0.4, {"chars": 4.0})
    assert asyncio.run(call_reward(from_file, "d", "52", "52", {})) == (1.0, {})
    assert asyncio.run(call_reward(from_file, "d", "52", "53", {})) == (0.0, {})


def test_bad_reward_specs_and_results_say_what_is_wrong(user_module):
    with pytest.raises(ValueError, match="expected 'package.module:function'"):
        load_reward_fn("my_rewards.length_reward")
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        load_reward_fn("no_such_module:f")
    with pytest.raises(ValueError, match="has no callable named 'NOT_CALLABLE'"):
        load_reward_fn("my_rewards:NOT_CALLABLE")
    with pytest.raises(ValueError, match="does not exist"):
        load_reward_fn(f"{user_module / 'missing.py'}:f")
    with pytest.raises(TypeError, match="returned str; return a number or a dict with 'score'"):
        asyncio.run(call_reward(load_reward_fn("my_rewards:returns_text"), "d", "x", None, {}))


def _text_tokenizer():
    # characters as tokens, with a chat template that renders "<content>?" plus a generation prompt "="
    tok = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789 ?=")
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}?{% endfor %}{% if add_generation_prompt %}={% endif %}"
    )
    return tok


def test_a_task_scores_with_the_user_reward_plus_the_overlong_penalty(user_module):
    config = TaskConfig(
        name="custom", reward="my_rewards:length_reward", overlong_buffer=4, overlong_penalty=1.0
    )
    tok = _text_tokenizer()
    task = CustomTask(config, tok, max_new_tokens=8)
    row = PromptRow(index=0, data_source="d", prompt=[{"role": "user", "content": "ab"}], ground_truth=None)
    # chat template: "ab?=" with no BOS (apply_chat_template adds none); a=4 b=5 ?=41 '='=42
    assert task.prompt_ids(row) == [4, 5, 41, 42]
    response = task.response_ids("abcdef")  # 6 characters + EOS = 7 tokens
    score = asyncio.run(task.score(row, response))
    # length reward 6/10 = 0.6; 7 tokens with max 8 and buffer 4 exceed 4 by 3: penalty -3/4
    assert score.reward == pytest.approx(0.6 - 0.75)
    assert score.metrics == pytest.approx({"score": 0.6, "chars": 6.0, "overlong_penalty": -0.75})


def test_chat_prompts_need_a_chat_template():
    config = TaskConfig(name="gsm8k")
    from tidal.rollout.tasks.gsm8k import Gsm8kTask

    task = Gsm8kTask(config, build_char_tokenizer(), max_new_tokens=8)
    row = PromptRow(index=3, data_source="d", prompt=[{"role": "user", "content": "1+1"}])
    with pytest.raises(ValueError, match="row 3 .* has chat messages but the tokenizer has no chat template"):
        task.prompt_ids(row)


def test_reward_workers_score_in_a_separate_process_like_inline():
    config = TaskConfig(name="gsm8k", reward_workers=1)
    from tidal.rollout.tasks.gsm8k import Gsm8kTask

    tok = _text_tokenizer()
    task = Gsm8kTask(config, tok, max_new_tokens=16)
    try:
        row = PromptRow(index=0, data_source="openai/gsm8k", prompt="q", ground_truth="72")
        good = asyncio.run(task.score(row, task.response_ids("so 72")))
        bad = asyncio.run(task.score(row, task.response_ids("so 71")))
    finally:
        task.close()
    assert (good.reward, bad.reward) == (1.0, 0.0)
    assert score_in_worker(
        "tidal.rollout.rewards:math_verify_score",
        {"data_source": "x", "solution_str": "#### 72", "ground_truth": "72", "extra_info": {}},
    ) == (1.0, {})

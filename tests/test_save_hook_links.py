"""A save hook that links a file into the checkpoint folder: the checkpoint stores the file's bytes (a
copy), and a link that cannot be stored (to a folder, dangling) is refused before anything is committed,
so retention never deletes the older checkpoint for a checkpoint that cannot load."""

import pytest

from distributed import run_checks


@pytest.fixture(scope="module", params=[1, 2], ids=["1 process", "2 processes"])
def report(request):
    return run_checks("checks_save_hook_links", world_size=request.param)


def test_a_linked_file_is_stored_as_a_copy(report):
    for per_rank in report.assert_passed("check_a_linked_file_is_stored_as_a_copy"):
        for background, got in per_rank.items():
            assert got["link"] is False, (background, got)
            assert got["bytes"] == '{"vocab": ["a", "b"]}', (background, got)
            assert got["left"] == ["checkpoint_1"] and got["loaded"] == "checkpoint_1", (background, got)


def test_a_link_that_cannot_be_stored_is_refused_and_the_older_checkpoint_kept(report):
    for per_rank in report.assert_passed("check_a_link_that_cannot_be_stored_is_refused_and_the_older_checkpoint_kept"):
        for case, got in per_rank.items():
            what = "a folder" if case.startswith("folder") else "cannot be read"
            assert "'tokenizer'" in got["error"] and what in got["error"], (case, got)
            assert got["left"] == ["checkpoint_0"] and got["loaded"] == "checkpoint_0", (case, got)


def test_links_in_a_one_process_save(report):
    values = report.assert_passed("check_links_in_a_one_process_save")
    names = [f"linked_{r}.json" for r in range(report.world_size)]
    assert all(v == {"names": names, "links": []} for v in values), values

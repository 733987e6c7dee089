"""Video files in the scan: header facts of real tiny clips (PyAV), corrupt files rejected with a reason, the
frame bucketing (4k+1 frames at the bucket's rate; start, center, every) and the frame indices it decodes."""

from __future__ import annotations

import pytest

from tests.clips import write_clip, write_gif
from tuneline.stages.common.sizing import FramePolicy, clip_ranges, frame_count, frame_indices
from tuneline.stages.scan import video
from tuneline.stages.scan.listing import Entry

WAN = FramePolicy(fps=16, budgets=(17, 33, 49, 81), factor=4)


def probe(e: Entry):
    return video.probe(e, "wan")  # a video family reads every clip's headers


def entry(path) -> Entry:
    st = path.stat()
    return Entry(path.name, str(path), st.st_size, st.st_mtime_ns)


@pytest.mark.parametrize("ext", [".mp4", ".webm", ".mov", ".mkv"])
def test_probe_reads_size_frames_and_rate_from_the_header(tmp_path, ext):
    p = probe(entry(write_clip(tmp_path / f"c{ext}", frames=12, fps=24, size=(32, 16))))
    assert not p.error, p.error
    assert (p.width, p.height, p.frames, p.fps) == (32, 16, 12, 24.0)
    assert len(p.sha256) == 64 and p.orientation == 1


def test_a_rotated_clip_is_measured_upright(tmp_path):
    p = probe(entry(write_clip(tmp_path / "r.mp4", frames=5, fps=16, size=(32, 16), rotation=90)))
    assert (p.width, p.height, p.orientation) == (16, 32, 8)


def test_a_corrupt_or_empty_video_is_rejected_with_a_reason(tmp_path):
    good = write_clip(tmp_path / "g.mp4", frames=5, fps=16).read_bytes()
    (tmp_path / "cut.mp4").write_bytes(good[: len(good) // 3])
    (tmp_path / "junk.webm").write_bytes(b"not a video at all" * 10)
    (tmp_path / "empty.mkv").write_bytes(b"")
    for name, kind in [("cut.mp4", "unreadable"), ("junk.webm", "unreadable"), ("empty.mkv", "empty-file")]:
        p = probe(entry(tmp_path / name))
        assert p.kind == kind and "re-" in p.error, (name, p)


def test_an_animated_gif_has_frames_and_a_rate(tmp_path):
    p = probe(entry(write_gif(tmp_path / "a.gif", frames=6, ms=50)))
    assert (p.format, p.frames, p.fps, p.width, p.height) == ("GIF", 6, 20.0, 32, 16)


def test_frames_follow_the_4k_plus_1_rule_at_the_bucket_rate():
    assert frame_count(81 * 30 // 16 + 1, 30, WAN) == 81  # 5 s at 30 fps holds 81 frames at 16 fps
    assert frame_count(40, 16, WAN) == 33
    assert frame_count(12, 16, WAN) == 9  # shorter than every budget: the largest 4k+1 it holds
    assert frame_count(1, 16, WAN) == 1
    for n in range(1, 200):
        assert (frame_count(n, 24, WAN) - 1) % 4 == 0


def test_clip_policies_cut_start_center_and_every():
    start = clip_ranges(40, 16, WAN)  # 2.5 s: one 33-frame clip of 2.0625 s
    center = clip_ranges(40, 16, FramePolicy(16, (17, 33), 4, "center"))
    every = clip_ranges(120, 16, FramePolicy(16, (17, 33), 4, "every"))  # 7.5 s: three 33-frame clips
    assert start == [(33, 0.0, 2.0625)]
    assert center == [(33, 0.21875, 2.28125)]
    assert every == [(33, 0.0, 2.0625), (33, 2.0625, 4.125), (33, 4.125, 6.1875)]


def test_frame_indices_resample_to_the_bucket_rate():
    assert frame_indices(0.0, 5, 16, 32, 100) == [0, 2, 4, 6, 8]
    assert frame_indices(0.0, 5, 16, 8, 100) == [0, 0, 1, 1, 2]  # a slower file repeats frames
    assert frame_indices(1.0, 3, 16, 16, 100) == [16, 17, 18]


def test_frame_budgets_that_break_the_family_rule_are_refused():
    from tuneline.schemas.config import ConfigError, parse_config

    base = {"dataset": {"path": "data"}, "model": {"family": "wan"}, "buckets": {"frames": [17, 30]}}
    with pytest.raises(ConfigError, match=r"buckets.frames \[17, 30\]: \[30\] break family 'wan'.*use \[29\]"):
        parse_config(base)
    assert parse_config({**base, "buckets": {"frames": [5, 29]}}).buckets.frames == [5, 29]


def test_an_image_family_refuses_a_video_by_its_name_without_reading_it(tmp_path):
    (tmp_path / "junk.mp4").write_bytes(b"not a video at all" * 10)  # read, it would be "unreadable"
    p = video.probe(entry(tmp_path / "junk.mp4"), "sd15")
    assert p.kind == "video" and "model.family 'sd15' trains on images" in p.error and "wan" in p.error
    assert not p.sha256  # never hashed

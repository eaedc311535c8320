"""bench/stream_libraries.py runs in the project's environment: vramfit's two cases measured, a
library that is not installed skipped with its reason."""

from helpers import bench_module


def test_the_vramfit_cases_run_and_a_missing_library_is_skipped(tmp_path, monkeypatch, capsys):
    bench = bench_module("stream_libraries")
    monkeypatch.setitem(bench.PACKAGES, "webdataset", "no_such_package_for_this_test")
    code = bench.main(["--images", "48", "--batch", "8", "--image-size", "32", "--workers", "0",
                       "--repeats", "1", "--cases", "map-style,vramfit,webdataset",
                       "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "skipped webdataset: `no_such_package_for_this_test` is not installed" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split()[:1] in (["map-style"], ["vramfit"], ["webdataset"]) and "images/s" not in line}
    assert set(rows) == {"map-style", "vramfit"}, out
    assert rows["map-style"][2] == "1.00x", out
    for case, row in rows.items():
        assert float(row[1]) > 0 and row[3] == "yes", row  # images/s, exact resume
        assert row[4:] == ["yes", "(measured)"], row  # the same steps at 2 processes

"""Hardware profiles: the shipped ones load, bad files fail naming the field, and the alpha-beta
they give per world size follows the hierarchy the module documents."""

from __future__ import annotations

import pytest
import yaml

from lightning_sparselift.simulate.profile import DEFAULT_PROFILE, PROFILES, HardwareProfile, shipped_profiles


def test_the_shipped_profiles_load_and_cite_their_sources():
    assert DEFAULT_PROFILE in shipped_profiles()
    for name in shipped_profiles():
        profile = HardwareProfile.load(name)
        assert profile.sources, name
        # a measured profile says what it was fitted on; a published one was not measured
        assert (profile.measured is not None) == (profile.device.kind == "cpu"), name


def _write(tmp_path, edit):
    data = yaml.safe_load((PROFILES / f"{DEFAULT_PROFILE}.yaml").read_text())
    edit(data)
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["device"].pop("dense_tflops"), "dense_tflops"),
    (lambda d: d["intra_node"].update(gb_per_s="fast"), "gb_per_s"),
    (lambda d: d["inter_node"].update(gb_per_s=0), "inter_node.gb_per_s must be positive"),
    (lambda d: d["device"].update(launch_us=-1), "device.launch_us must not be negative"),
    (lambda d: d["device"].update(kind="tpu"), "kind"),
])
def test_a_bad_profile_names_its_field(tmp_path, edit, message):
    with pytest.raises(ValueError, match=message):
        HardwareProfile.load(str(_write(tmp_path, edit)))


def test_a_user_profile_is_read_from_its_file(tmp_path):
    path = _write(tmp_path, lambda d: d.update(name="mine", ranks_per_node=4))
    assert HardwareProfile.load(str(path)).ranks_per_node == 4


def test_an_unknown_profile_lists_the_shipped_ones():
    with pytest.raises(ValueError, match="not one of the shipped profiles"):
        HardwareProfile.load("no-such-machine")


def test_the_all_to_all_inside_a_node_and_across_nodes():
    p = HardwareProfile.load(DEFAULT_PROFILE)
    intra, inter = p.intra_node, p.inter_node
    inside = p.all_to_all(8, "world[8]")
    assert inside.alpha_ms == pytest.approx((intra.alpha_us + 7 * intra.per_peer_us) / 1e3)
    assert inside.beta_ms_per_byte == pytest.approx(7 / 8 / (intra.gb_per_s * 1e6))
    across = p.all_to_all(64, "world[64]")
    assert across.alpha_ms == pytest.approx((intra.alpha_us + 7 * intra.per_peer_us + inter.alpha_us
                                             + 56 * inter.per_peer_us) / 1e3)
    # the network is the slower path: 56/64 of the bytes leave the node
    assert across.beta_ms_per_byte == pytest.approx(56 / 64 / (inter.gb_per_s * 1e6))
    # bytes per peer shrink like 1/N: at large N the latency terms dominate a fixed payload
    small = 64 * 1024
    big = p.all_to_all(1024, "world[1024]")
    assert big.alpha_ms > big.beta_ms_per_byte * small


def test_the_dense_all_reduce_is_a_ring_over_the_slowest_link():
    p = HardwareProfile.load(DEFAULT_PROFILE)
    assert p.all_reduce_ms(1, 1e6) == 0.0
    assert p.all_reduce_ms(8, 1e6) == pytest.approx(p.intra_node.alpha_us / 1e3 + 2 * 7 / 8 * 1e6 /
                                                    (p.intra_node.gb_per_s * 1e6))
    assert p.all_reduce_ms(16, 1e6) == pytest.approx(p.inter_node.alpha_us / 1e3 + 2 * 15 / 16 * 1e6 /
                                                     (p.inter_node.gb_per_s * 1e6))

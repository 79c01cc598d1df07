"""numbaccum.dp_epsilon (Google's dp-accounting, RDP and PLD) against Opacus' RDPAccountant and
PRVAccountant on the same inputs, and against the DP-SGD paper's figure.

Prints the table of the closing note and the vectors of tests/test_privacy.py's OPACUS (Opacus
needs PyTorch, which CI does not install: its answers are recorded there).

    pip install opacus dp-accounting && python benchmarks/dp_accountant.py
"""

from __future__ import annotations

import warnings

import numbaccum as nba

CASES = [  # (noise_multiplier, sampling_rate, steps, delta)
    (4.0, 0.01, 10000, 1e-5),  # Abadi et al. 2016, section 3.1: epsilon 1.26 (moments accountant)
    (1.1, 256 / 60000, 14100, 1e-5),  # MNIST, batch 256, 60 epochs
    (0.8, 0.004, 5000, 1e-6),
    (2.0, 0.1, 100, 1e-5),
]


def main() -> None:
    from opacus.accountants import PRVAccountant, RDPAccountant

    print("| sigma | q | steps | delta | numbaccum RDP | Opacus RDP | numbaccum PLD | Opacus PRV |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for s, q, t, d in CASES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Opacus: "optimal order is the largest alpha"
            rdp, prv = RDPAccountant(), PRVAccountant()
            rdp.history, prv.history = [(s, q, t)], [(s, q, t)]
            o_rdp, o_prv = rdp.get_epsilon(d), float(prv.get_epsilon(d))
        ours, pld = nba.dp_epsilon(s, q, t, d), nba.dp_epsilon(s, q, t, d, accountant="pld")
        print(f"| {s} | {q:.5g} | {t} | {d:g} | {ours:.6f} | {o_rdp:.6f} | {pld:.6f} | {o_prv:.6f} |")


if __name__ == "__main__":
    main()

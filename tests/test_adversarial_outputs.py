"""Issue 40, the third adversarial round: its results, gate and data half (N2–N7, N10, N12, round 2's W6). Each
test is a case a hostile user tried on main at 51430f3 that went wrong then."""

import pytest

from pkvbench.metrics import final_number


@pytest.mark.parametrize(
    "prediction, number",
    [
        ("\\boxed{1{,}250}", "1250"),  # N5: TeX's thousands separators, not "250"
        ("\\boxed{1\\,250}", "1250"),
        ("\\boxed{12\\,345\\,678}", "12345678"),
        ("\\boxed{\u22125}", "-5"),  # the Unicode minus, not 5
        ("\\boxed 5 and then {10}", "5"),  # \boxed without braces takes its own word, not a later group
        ("\\boxed 1{,}250.", "1250"),
        ("In 4 weeks: 5\u202f000 pens", "5000"),  # a narrow no-break space between thousands
        ("pages 3\u20135", "5"),  # an en dash is no minus sign
    ],
)
def test_boxed_answers_read_tex_separators_and_the_unicode_minus(prediction, number):
    assert final_number(prediction) == number

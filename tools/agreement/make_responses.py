"""Write the stored responses that the agreement test scores with the pipeline and with a reference harness.

    .venv/bin/python tools/agreement/make_responses.py    # writes tests/data/agreement/{math500,gsm8k}.jsonl

Each case is a problem in its benchmark's published layout (MATH-500's problem / solution / answer, GSM8K's
question / answer ending in `#### <number>`) and one response, in the forms models write: the answer boxed as the
solution writes it, boxed in an equivalent form, stated without a box, in the Minerva "Final Answer:" sentence,
an `Answer:` line, wrong, cut off before an answer, several answers; and for GSM8K the `#### ` marker with commas, a
dollar sign, a trailing period, twice, or far before the end. The problems are written here (no hub), in the
benchmarks' styles; the reference scores come from tools/agreement/reference_scores.py.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "tests" / "data" / "agreement"

# (problem, answer as the solution boxes it, equivalent forms a model may write, a wrong answer)
MATH = [
    ("Compute $\\frac{3}{4} - \\frac{1}{4}$.", "\\frac{1}{2}", ["0.5", "\\dfrac{1}{2}", "1/2"], "\\frac{1}{4}"),
    ("Simplify $\\sqrt{18}$.", "3\\sqrt{2}", ["\\sqrt{18}", "3 \\sqrt 2"], "2\\sqrt{3}"),
    ("Solve $x^2 - 5x + 6 = 0$ and give the larger root.", "3", ["3.0", "x = 3"], "2"),
    ("Find the domain of $\\sqrt{x-2}/\\sqrt{5-x}$ in interval notation.", "[2,5)", ["[2, 5)"], "(2,5]"),
    ("What is $4!$?", "24", ["24.0", "4! = 24"], "12"),
    ("If $6x-4y=a$ and $6y-9x=b$, find $\\frac{a}{b}$.", "-\\frac{2}{3}", ["-2/3", "\\frac{-2}{3}"], "\\frac{2}{3}"),
    ("What is the area of a circle of radius $1$?", "\\pi", ["1\\pi", "\\pi r^2 = \\pi"], "2\\pi"),
    ("Give the point where $y = x + 1$ meets $y = 3x - 1$.", "(1,2)", ["(1, 2)"], "(2,1)"),
    ("What is $10\\%$ of $250$?", "25", ["25.00"], "2.5"),
    ("Evaluate $\\log_2 64$.", "6", ["6"], "8"),
    ("How many degrees are in each interior angle of a regular hexagon?", "120^\\circ", ["120", "120^{\\circ}"],
     "60^\\circ"),
    ("Express $0.\\overline{3}$ as a common fraction.", "\\frac{1}{3}", ["1/3", "\\tfrac13"], "\\frac{3}{10}"),
    ("Find $x$ if $2^x = 32$.", "5", ["x=5"], "4"),
    ("Compute $\\binom{6}{2}$.", "15", ["15"], "30"),
    ("What is the sum of the roots of $x^2 - 7x + 10$?", "7", ["7"], "10"),
    ("Rationalize $\\frac{1}{\\sqrt{2}}$.", "\\frac{\\sqrt{2}}{2}", ["\\frac{1}{\\sqrt{2}}", "\\sqrt{2}/2"],
     "\\sqrt{2}"),
    ("Expand $(x+1)^2$.", "x^2+2x+1", ["x^2 + 2x + 1", "1 + 2x + x^2"], "x^2+1"),
    ("Find all $x$ with $|x| = 3$.", "-3, 3", ["3, -3", "\\pm 3"], "3"),
    ("What is $\\sin 30^\\circ$?", "\\frac{1}{2}", ["0.5"], "\\frac{\\sqrt{3}}{2}"),
    ("Write $\\frac{7}{8}$ as a decimal.", "0.875", [".875", "\\frac{7}{8}"], "0.78"),
    ("Compute $i^2$.", "-1", ["-1"], "1"),
    ("Find the slope of the line through $(0,0)$ and $(2,6)$.", "3", ["\\frac{6}{2}"], "\\frac{1}{3}"),
    ("What is $2^{10}$?", "1024", ["1,024", "1024"], "2048"),
    ("Give the vertex of $y=(x-2)^2+3$.", "(2,3)", ["(2, 3)"], "(-2,3)"),
    ("Solve $3x+2>8$.", "(2,\\infty)", ["x > 2", "(2, \\infty)"], "(-\\infty,2)"),
    ("What is the greatest common divisor of $84$ and $36$?", "12", ["12"], "6"),
    ("Simplify $\\frac{x^2-1}{x-1}$ for $x \\neq 1$.", "x+1", ["1+x"], "x-1"),
    ("A fair die is rolled. What is the probability of a prime number?", "\\frac{1}{2}", ["\\frac{3}{6}", "50\\%"],
     "\\frac{1}{3}"),
    ("Find the determinant of $\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}$.", "-2", ["-2"], "2"),
    ("Which letter names the correct choice: (A) 1, (B) 2, (C) 3, if the answer is $2$?", "\\text{(B)}",
     ["(B)", "\\textbf{(B)}"], "\\text{(C)}"),
    ("Compute $\\sqrt{2} \\cdot \\sqrt{8}$.", "4", ["\\sqrt{16}"], "16"),
    ("In base 10, what is $101_2$?", "5", ["5"], "101"),
]

GSM8K = [
    ("Natalia sold 48 clips in April and half as many in May. How many clips did she sell in all?",
     "In May she sold 48/2 = <<48/2=24>>24 clips.\nIn all she sold 48+24 = <<48+24=72>>72 clips.\n#### 72", "72", "66"),
    ("Weng earns $12 an hour for babysitting. Yesterday she did 50 minutes. How much did she earn?",
     "She earns 12/60 = $<<12/60=0.2>>0.2 a minute.\nSo she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10", "10", "12"),
    ("Betty needs $100 for a wallet. She has half, her parents give $15 and her grandparents twice that. How much more?",
     "She has 100/2 = $<<100/2=50>>50.\nGrandparents give 15*2 = $<<15*2=30>>30.\nShe needs 100-50-30-15 = "
     "$<<100-50-30-15=5>>5 more.\n#### 5", "5", "15"),
    ("A factory makes 1250 toys a day. How many toys does it make in 30 days?",
     "1250 * 30 = <<1250*30=37500>>37500\n#### 37500", "37500", "3750"),
    ("James writes a 3-page letter to 2 friends twice a week. How many pages does he write a year?",
     "3*2*2 = <<3*2*2=12>>12 pages a week.\n12*52 = <<12*52=624>>624 pages.\n#### 624", "624", "312"),
    ("The temperature fell from 4 degrees to 11 degrees below zero. What is the new temperature?",
     "4 - 15 = <<4-15=-11>>-11\n#### -11", "-11", "11"),
    ("A shop sells pens at $3 each. How much do 1200 pens cost?",
     "1200 * 3 = <<1200*3=3600>>3600\n#### 3600", "3600", "360"),
    ("Mark has 3 bags of 25 marbles and gives away 17. How many are left?",
     "3*25 = <<3*25=75>>75.\n75-17 = <<75-17=58>>58.\n#### 58", "58", "92"),
    ("A recipe needs 2.5 cups of flour per cake. How many cups for 4 cakes?",
     "2.5*4 = <<2.5*4=10>>10\n#### 10", "10", "8"),
    ("Tom runs 5 miles a day for 2 weeks. How many miles?",
     "5*14 = <<5*14=70>>70\n#### 70", "70", "35"),
    ("A school has 1,540 students in 35 classes of equal size. How many students are in a class?",
     "1540/35 = <<1540/35=44>>44\n#### 44", "44", "45"),
    ("Sam buys 12 eggs and breaks 3. He uses half of the rest. How many eggs does he have left?",
     "12-3 = <<12-3=9>>9.\nHalf of 9 is 4.5, so he has 4.5 left.\n#### 4.5", "4.5", "6"),
    ("A car travels 60 miles an hour for 2.5 hours. How far does it go?",
     "60*2.5 = <<60*2.5=150>>150\n#### 150", "150", "120"),
    ("An orchard has 15 rows of 24 trees. How many trees?",
     "15*24 = <<15*24=360>>360\n#### 360", "360", "39"),
    ("A worker earns $2,000 a month. How much in a year?",
     "2000*12 = <<2000*12=24000>>24000\n#### 24000", "24000", "2400"),
    ("Lisa has 7 apples and buys 5 more, then eats 2. How many apples now?",
     "7+5-2 = <<7+5-2=10>>10\n#### 10", "10", "14"),
]

FILLER = ("Let me double check each step of the computation once more, carefully, so that nothing was missed along "
          "the way and the arithmetic holds. ")


def math_solution(answer: str) -> str:
    return f"Working through the problem step by step gives the result, so the answer is $\\boxed{{{answer}}}$."


def math_responses(answer: str, equivalents: list[str], wrong: str) -> list[tuple[str, str]]:
    """(form, response) pairs of the forms a model writes."""
    reasoning = "We work it out step by step. "
    forms = [
        ("boxed", f"{reasoning}So the answer is $\\boxed{{{answer}}}$."),
        ("boxed-twice", f"{reasoning}First guess $\\boxed{{{wrong}}}$, but checking again gives $\\boxed{{{answer}}}$."),
        ("boxed-then-wrong", f"{reasoning}We get $\\boxed{{{answer}}}$. On reflection the answer is $\\boxed{{{wrong}}}$."),
        ("wrong", f"{reasoning}Therefore the answer is $\\boxed{{{wrong}}}$."),
        ("minerva", f"{reasoning}\nFinal Answer: The final answer is ${answer}$. I hope it is correct."),
        ("answer-line", f"{reasoning}\nAnswer: {answer}"),
        ("plain", f"{reasoning}The answer is {answer}."),
        ("cut-off", f"{reasoning}First we note that the expression"),
        ("long", f"{reasoning}{FILLER * 40}So the answer is $\\boxed{{{answer}}}$."),
    ]
    forms += [(f"equivalent-{index}", f"{reasoning}So the answer is $\\boxed{{{form}}}$.")
              for index, form in enumerate(equivalents)]
    return forms


def gsm8k_responses(answer: str, wrong: str) -> list[tuple[str, str]]:
    number = f"{int(answer):,}" if answer.lstrip("-").isdigit() else answer
    reasoning = "Let's compute it step by step.\n"
    return [
        ("marker", f"{reasoning}#### {answer}"),
        ("marker-commas", f"{reasoning}#### {number}"),
        ("marker-dollar", f"{reasoning}#### ${answer}"),
        ("marker-period", f"{reasoning}#### {answer}."),
        ("wrong", f"{reasoning}#### {wrong}"),
        ("no-marker", f"{reasoning}The answer is {answer}."),
        ("marker-twice-last-right", f"{reasoning}#### {wrong}\nWait, that is wrong.\n#### {answer}"),
        ("marker-twice-first-right", f"{reasoning}#### {answer}\nHmm, or maybe\n#### {wrong}"),
        ("marker-early", f"{reasoning}#### {answer}\n{FILLER * 4}"),
        ("marker-space", f"{reasoning}####{answer}"),
    ]


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    math_cases = []
    for index, (problem, answer, equivalents, wrong) in enumerate(MATH):
        for form, response in math_responses(answer, equivalents, wrong):
            math_cases.append({"id": f"math500-{index}-{form}", "problem": problem, "form": form,
                               "solution": math_solution(answer), "answer": answer, "response": response})
    gsm8k_cases = []
    for index, (question, solution, answer, wrong) in enumerate(GSM8K):
        for form, response in gsm8k_responses(answer, wrong):
            gsm8k_cases.append({"id": f"gsm8k-{index}-{form}", "question": question, "form": form, "answer": solution,
                                "ground_truth": answer, "response": response})
    for name, cases in (("math500", math_cases), ("gsm8k", gsm8k_cases)):
        (OUT / f"{name}.jsonl").write_text("".join(json.dumps(case) + "\n" for case in cases))
        print(f"{OUT / f'{name}.jsonl'}: {len(cases)} responses")


if __name__ == "__main__":
    main()

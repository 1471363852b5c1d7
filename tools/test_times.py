#!/usr/bin/env python3
"""tools/test_times.py SUITE.xml: the time of a pytest run per test module, from its JUnit XML (pytest
--junitxml=SUITE.xml). Under pytest -n 2 two modules run at once, so the column adds up to more than the wall
time; the last line gives both."""
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def module_times(xml_path: str) -> tuple:
    """({module: [tests, seconds]}, the run's wall seconds) of a JUnit XML report."""
    root = ET.parse(xml_path).getroot()
    suite = root if root.tag == 'testsuite' else root.find('testsuite')
    modules = defaultdict(lambda: [0, 0.0])
    for case in suite.iter('testcase'):
        parts = case.get('classname', '').split('.')  # tests.test_x, or tests.test_x.TestClass
        module = modules[next((part for part in parts if part.startswith('test_')), '?')]
        module[0] += 1
        module[1] += float(case.get('time', 0))
    return dict(modules), float(suite.get('time', 0))


def table(modules: dict, wall: float) -> str:
    rows = ['| module | tests | seconds |', '|---|---:|---:|']
    rows += [f'| {name} | {tests} | {seconds:.0f} |'
             for name, (tests, seconds) in sorted(modules.items(), key=lambda row: -row[1][1])]
    total_tests = sum(tests for tests, _ in modules.values())
    total = sum(seconds for _, seconds in modules.values())
    rows.append(f'| all | {total_tests} | {total:.0f} (wall {wall:.0f}) |')
    return '\n'.join(rows)


if __name__ == '__main__':
    if len(sys.argv) != 2:
        sys.exit('usage: tools/test_times.py SUITE.xml  (from pytest --junitxml=SUITE.xml)')
    try:
        print(table(*module_times(sys.argv[1])))
    except (OSError, ET.ParseError) as error:
        sys.exit(f'tools/test_times.py: cannot read {sys.argv[1]}: {error}')

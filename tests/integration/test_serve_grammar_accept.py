"""Issue 28's validity acceptance for structured output, end to end against `shoal serve` on the
default model at temperature 1.0: 30 JSON schemas (the 12 of test_serve_grammar and 18 more:
nested, recursive, enums, arrays with bounds, anyOf, string and number bounds, formats) and
10 GBNF grammars (arithmetic, CSV rows, a small programming-language subset and others), each
output checked by something other than the server's grammar engine: the `jsonschema` package
for the schemas, a parser written here for each grammar.

Every output whose finish_reason is not "length" must parse and validate (100%); an output cut
by max_tokens must say "length". The number of requests per schema and grammar is
SH_GRAMMAR_ACCEPT_N: 2 by default (the suite's run), 20 for the acceptance run:
  SH_GRAMMAR_ACCEPT_N=20 ctest -R test_serve_grammar_accept
Needs jsonschema (scripts/test-venv.sh installs it): skips (77) without it.
"""

import json
import os
import re
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402
import test_serve_grammar as tg  # noqa: E402

try:
    import jsonschema
except ImportError:
    jsonschema = None

PER = int(os.environ.get("SH_GRAMMAR_ACCEPT_N", "2"))
MAX_TOKENS = 200
WAVE = 48  # requests in flight at once

MORE_SCHEMAS = [
    # enums of several types, and a boolean
    {"type": "object", "properties": {"size": {"enum": ["S", "M", "L", 42, None]},
                                      "in_stock": {"type": "boolean"}},
     "required": ["size", "in_stock"], "additionalProperties": False},
    # nested three deep
    {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "object", "properties": {"c": {"type": "integer"}}, "required": ["c"]}},
        "required": ["b"]}}, "required": ["a"]},
    # an array of objects with bounds
    {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1},
                                         "label": {"type": "string", "maxLength": 12}},
        "required": ["id", "label"]}},
    # a recursive tree through $defs
    {"$defs": {"tree": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/tree"}}},
        "required": ["name", "children"]}}, "$ref": "#/$defs/tree"},
    # anyOf of objects and a string
    {"anyOf": [{"type": "object", "properties": {"ok": {"const": True}}, "required": ["ok"]},
               {"type": "object", "properties": {"error": {"type": "string", "maxLength": 30}},
                "required": ["error"]},
               {"type": "string", "maxLength": 5}]},
    # numbers with exclusive bounds and integers with both bounds
    {"type": "object", "properties": {"p": {"type": "number", "exclusiveMinimum": 0,
                                            "exclusiveMaximum": 1},
                                      "n": {"type": "integer", "minimum": -10, "maximum": 10}},
     "required": ["p", "n"]},
    # string length bounds
    {"type": "object", "properties": {"code": {"type": "string", "minLength": 3,
                                               "maxLength": 3},
                                      "note": {"type": "string", "minLength": 1,
                                               "maxLength": 15}},
     "required": ["code", "note"]},
    # a date and an email-like pattern
    {"type": "object", "properties": {"day": {"type": "string", "format": "date"},
                                      "ref": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
     "required": ["day", "ref"]},
    # an array of enums with uniqueness not required, fixed length
    {"type": "array", "items": {"enum": ["up", "down", "left", "right"]}, "minItems": 3,
     "maxItems": 3},
    # optional properties only
    {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "string",
                                                                      "maxLength": 6}}},
    # a union type with bounds
    {"type": ["integer", "boolean"], "minimum": 0, "maximum": 50},
    # const in a nested array
    {"type": "object", "properties": {"v": {"const": 2}, "items": {
        "type": "array", "items": {"type": "number"}, "maxItems": 4}},
     "required": ["v", "items"]},
    # prefixItems with further items allowed
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string", "maxLength": 6}],
     "items": {"type": "boolean"}, "minItems": 2, "maxItems": 4},
    # oneOf of enums that do not overlap
    {"oneOf": [{"enum": ["alpha", "beta"]}, {"enum": [1, 2, 3]}]},
    # a recursive arithmetic expression tree
    {"$defs": {"e": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 9},
        {"type": "object", "properties": {"op": {"enum": ["+", "*"]},
                                          "l": {"$ref": "#/$defs/e"},
                                          "r": {"$ref": "#/$defs/e"}},
         "required": ["op", "l", "r"]}]}}, "$ref": "#/$defs/e"},
    # a map with additionalProperties of a type
    {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}},
    # null, numbers and strings in an array of anyOf
    {"type": "array", "maxItems": 5, "items": {"anyOf": [{"type": "null"}, {"type": "number"},
                                                         {"type": "string", "maxLength": 4}]}},
    # an object with required and optional fields and a nested enum array
    {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 20},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "sf"]},
                   "minItems": 1, "maxItems": 2},
        "rating": {"type": "number", "minimum": 0, "maximum": 10}},
     "required": ["title", "year", "genres"], "additionalProperties": False},
]

SCHEMAS = tg.SCHEMAS + MORE_SCHEMAS


# ---- GBNF grammars and their parsers ------------------------------------------------------

LANG = r'''
root ::= stmt{1,3}
stmt ::= "let " ident " = " expr ";\n" | "print(" expr ");\n"
ident ::= [a-z] [a-z0-9_]{0,5}
expr ::= atom (" " op " " atom){0,2}
op ::= "+" | "-" | "*"
atom ::= ident | [0-9]{1,3}
'''

LANG_STMT = re.compile(r"(?:let ([a-z][a-z0-9_]{0,5}) = (E);\n|print\((E)\);\n)".replace(
    "E", r"(?:[a-z][a-z0-9_]{0,5}|[0-9]{1,3})(?: [+\-*] (?:[a-z][a-z0-9_]{0,5}|[0-9]{1,3}))"
         r"{0,2}"))


def parse_lang(s):
    pos, n = 0, 0
    while pos < len(s):
        m = LANG_STMT.match(s, pos)
        if not m:
            return False
        pos, n = m.end(), n + 1
    return 1 <= n <= 3


BOOL = r'''
root ::= bexpr
bexpr ::= bterm (" or " bterm){0,2}
bterm ::= bfactor (" and " bfactor){0,2}
bfactor ::= "true" | "false" | "not " bfactor | "(" bexpr ")"
'''


def parse_bool(s):
    pos = 0

    def lit(t):
        nonlocal pos
        if s.startswith(t, pos):
            pos += len(t)
            return True
        return False

    def factor(depth):
        if depth > 40:
            return False
        if lit("true") or lit("false"):
            return True
        if lit("not "):
            return factor(depth + 1)
        if lit("("):
            return expr(depth + 1) and lit(")")
        return False

    def seq(item, sep, depth):
        if not item(depth):
            return False
        for _ in range(2):
            if not lit(sep):
                break
            if not item(depth):
                return False
        return True

    def term(depth):
        return seq(factor, " and ", depth)

    def expr(depth):
        return seq(term, " or ", depth)

    return expr(0) and pos == len(s)


DATES = r'''
root ::= date ("\n" date){0,3}
date ::= year "-" month "-" day
year ::= "19" [0-9] [0-9] | "20" [0-2] [0-9]
month ::= "0" [1-9] | "1" [0-2]
day ::= "0" [1-9] | [12] [0-9] | "3" [01]
'''


def parse_dates(s):
    d = r"(?:19[0-9]{2}|20[0-2][0-9])-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"
    return re.fullmatch(rf"{d}(?:\n{d}){{0,3}}", s) is not None


SEXPR = r'''
root ::= list
list ::= "(" item (" " item){0,3} ")"
item ::= atom | list
atom ::= [a-z]{1,6} | [0-9]{1,4}
'''


def parse_sexpr(s):
    pos = 0
    atom = re.compile(r"[a-z]{1,6}|[0-9]{1,4}")

    def item(depth):
        nonlocal pos
        if pos < len(s) and s[pos] == "(":
            return lst(depth + 1)
        m = atom.match(s, pos)
        if not m:
            return False
        pos = m.end()
        return True

    def lst(depth):
        nonlocal pos
        if depth > 40 or pos >= len(s) or s[pos] != "(":
            return False
        pos += 1
        if not item(depth):
            return False
        for _ in range(3):
            if pos < len(s) and s[pos] == " ":
                pos += 1
                if not item(depth):
                    return False
            else:
                break
        if pos >= len(s) or s[pos] != ")":
            return False
        pos += 1
        return True

    return lst(0) and pos == len(s)


IPV4 = r'''
root ::= addr ("," addr){0,2}
addr ::= octet "." octet "." octet "." octet
octet ::= "25" [0-5] | "2" [0-4] [0-9] | "1" [0-9] [0-9] | [1-9] [0-9] | [0-9]
'''


def parse_ipv4(s):
    o = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9][0-9]|[0-9])"
    a = rf"{o}\.{o}\.{o}\.{o}"
    return re.fullmatch(rf"{a}(?:,{a}){{0,2}}", s) is not None


INI = r'''
root ::= section{1,2}
section ::= "[" name "]\n" pair{1,3}
pair ::= name "=" value "\n"
name ::= [a-z] [a-z_]{0,7}
value ::= [0-9]{1,5} | "\"" [a-zA-Z ]{0,12} "\"" | "true" | "false"
'''


def parse_ini(s):
    name = r"[a-z][a-z_]{0,7}"
    value = r'(?:[0-9]{1,5}|"[a-zA-Z ]{0,12}"|true|false)'
    pair = rf"{name}={value}\n"
    return re.fullmatch(rf"(?:\[{name}\]\n(?:{pair}){{1,3}}){{1,2}}", s) is not None


WORDS = r'''
root ::= "[" word (", " word){0,4} "]"
word ::= [A-Z] [a-z]{1,9}
'''


def parse_words(s):
    return re.fullmatch(r"\[[A-Z][a-z]{1,9}(?:, [A-Z][a-z]{1,9}){0,4}\]", s) is not None


HEADERS = r'''
root ::= header{1,3} "\n"
header ::= hname ": " hvalue "\n"
hname ::= [A-Z] [a-z]{1,8} ("-" [A-Z] [a-z]{1,8})?
hvalue ::= [a-z0-9/.;=]{1,20}
'''


def parse_headers(s):
    h = r"[A-Z][a-z]{1,8}(?:-[A-Z][a-z]{1,8})?: [a-z0-9/.;=]{1,20}\n"
    return re.fullmatch(rf"(?:{h}){{1,3}}\n", s) is not None


GRAMMARS = [
    ("arith", tg.ARITH, "Write an arithmetic expression: ", tg.parse_arith),
    ("csv", tg.CSV, "name,city,age\n", tg.parse_csv),
    ("lang", LANG, "A short program:\n", parse_lang),
    ("bool", BOOL, "A boolean formula: ", parse_bool),
    ("dates", DATES, "Some dates:\n", parse_dates),
    ("sexpr", SEXPR, "A Lisp list: ", parse_sexpr),
    ("ipv4", IPV4, "IP addresses: ", parse_ipv4),
    ("ini", INI, "A config file:\n", parse_ini),
    ("words", WORDS, "A list of names: ", parse_words),
    ("headers", HEADERS, "HTTP headers:\n", parse_headers),
]


def in_waves(url, jobs, fn):
    out = []
    for k in range(0, len(jobs), WAVE):
        out += su.at_once(url, jobs[k:k + WAVE], 0, fn)
    return out


def schemas(url):
    check = tg.check
    jobs = [(i, k) for i in range(len(SCHEMAS)) for k in range(PER)]

    def one(url, job, _n):
        i, _ = job
        rf = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i]}}
        st, p, raw = tg.chat(url, "Answer with a JSON value.", max_tokens=MAX_TOKENS,
                             response_format=rf)
        check(st == 200, f"schema {i}: {st} {raw[:300]!r}")
        ch = p["choices"][0]
        return i, ch["message"]["content"], ch["finish_reason"]

    got = in_waves(url, jobs, one)
    cut, per = 0, [0] * len(SCHEMAS)
    for i, text, fin in got:
        if fin == "length":
            cut += 1
            continue
        check(fin == "stop", f"schema {i}: finish_reason {fin!r}")
        tg.validate(text, SCHEMAS[i], f"schema {i}")
        per[i] += 1
    # Most outputs must be whole, or the case checks little.
    check(cut <= len(got) // 3, f"{cut} of {len(got)} outputs cut by max_tokens")
    su.log(f"note: {len(SCHEMAS)} schemas x {PER}: {len(got) - cut} outputs validated, "
           f"{cut} cut by max_tokens; schemas with no whole output: "
           f"{[i for i, n in enumerate(per) if n == 0]}")


def grammars(url):
    check = tg.check
    jobs = [(g, k) for g in range(len(GRAMMARS)) for k in range(PER)]

    def one(url, job, _n):
        name, grammar, prompt, _ = GRAMMARS[job[0]]
        st, p, raw = su.post_json(url, "/v1/completions", {
            "prompt": prompt, "grammar": grammar, "temperature": 1.0, "max_tokens": 120},
            timeout=300)
        check(st == 200, f"{name}: {st} {raw[:300]!r}")
        ch = p["choices"][0]
        return job[0], ch["text"], ch["finish_reason"]

    got = in_waves(url, jobs, one)
    cut = 0
    for g, text, fin in got:
        name, _, _, parser = GRAMMARS[g]
        if fin == "length":
            cut += 1
            continue
        check(fin == "stop", f"{name}: finish_reason {fin!r}")
        check(parser(text), f"{name}: {text!r} does not parse")
    check(cut <= len(got) // 3, f"{cut} of {len(got)} outputs cut by max_tokens")
    su.log(f"note: {len(GRAMMARS)} grammars x {PER}: {len(got) - cut} outputs parsed, "
           f"{cut} cut by max_tokens")


def parsers_reject():
    """The parsers here are not vacuous: each refuses a near miss."""
    bad = {"arith": "1+", "csv": "a,b\n", "lang": "let x = ;\n", "bool": "true or",
           "dates": "2024-13-01", "sexpr": "(a b", "ipv4": "256.1.1.1", "ini": "[a]\n",
           "words": "[alice]", "headers": "Host: x\n"}
    good = {"arith": "1+2*(3-4)", "csv": "a,b,1\nc,d,2\n", "lang": "let x = 1 + y;\nprint(x);\n",
            "bool": "not (true and false) or true", "dates": "2024-12-01\n1999-01-31",
            "sexpr": "(a (b 12) c)", "ipv4": "10.0.0.1,255.255.255.0", "ini": "[a]\nb=1\n",
            "words": "[Alice, Bob]", "headers": "Content-Type: text/plain\n\n"}
    for name, _, _, parser in GRAMMARS:
        tg.check(not parser(bad[name]), f"{name} parser accepts {bad[name]!r}")
        tg.check(parser(good[name]), f"{name} parser refuses {good[name]!r}")
    json.dumps(SCHEMAS)  # every schema is plain JSON
    for s in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(s)


def main():
    su.require_model()
    if jsonschema is None:
        su.skip("the jsonschema package is missing (run scripts/test-venv.sh)")
    tg.check(len(SCHEMAS) >= 30 and len(GRAMMARS) >= 10, "fewer schemas or grammars than asked")
    r = su.Runner("test_serve_grammar_accept")
    r.case("parsers", parsers_reject)
    with su.server("--max-seqs", "64", runner=r) as srv:
        r.case("schemas", schemas, srv.url)
        r.case("grammars", grammars, srv.url)
    r.finish()


if __name__ == "__main__":
    main()

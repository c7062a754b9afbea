"""The pools the corpus generator draws from (paper §4.1): names, relations, profile facts,
preferences, summaries, general instructions; each split into disjoint TRAIN and HELDOUT parts.

The split is a fixed rule, the same on every machine and run: an item is held out when the first
four bytes of sha256("<pool>:<item>") are 0 mod 5 (about one in five), except the `CORE_RELATIONS`
and anything the general instructions say, which stay in training. Then a closure: a training item
that contains a held-out item as a whole word or phrase ("fried rice" vs "rice", "tennis partner" vs
"tennis", a surname equal to a held-out first name) is held out too, so nothing of the held-out split
occurs anywhere in training text. Names are built from syllables (thousands of them), so held-out
households are people the model has never heard of.

`pools(split)` is what the generator uses; `vocabulary_sizes()` is for docs and tests.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from egomem.relations import vocabulary as base_relation_words

Split = Literal["train", "heldout"]
HELDOUT_EVERY = 5  # one item in five is held out (before the closure moves a few more)
MAX_RELATION_CHARS = 22  # "Your <relation> <name> lives in <city>." must stay under ~60 characters

# ---------------------------------------------------------------------------- names (syllables)

_FIRST_ONSETS = ("B D F G H J K L M N P R S T V W Z Br Ch Cl Dr Fl Gr Kr Pr Sh St Tr Al Am An Ar El "
                 "Em Is Ol Or Ul").split()
_FIRST_VOWELS = "a e i o u ai".split()
_FIRST_ENDS = ("na la ra ri ro lo mi ko sa ta ven lin dra mar ren lia nor bel dan tha vi no "
               "sha zel").split()
_SURNAME_ONSETS = "B C D F G H K L M N P R S T V W Bl Br Cr Dr Gr Pr St Th Tr Wh".split()
_SURNAME_VOWELS = "a e i o u".split()
_SURNAME_ENDS = ("son ford ley wick man ton berg well by dale more field stein ett ard ock ins "
                 "hart wood cott").split()

# ---------------------------------------------------------------------------- relations

# Kept in training whatever the hash says: the words most dialogs are about.
CORE_RELATIONS = frozenset(("sister,brother,mother,father,son,daughter,wife,husband,partner,friend,best friend,"
                           "coworker,colleague,neighbour,boss,cousin,aunt,uncle,grandmother,grandfather,roommate,"
                           "girlfriend,boyfriend").split(","))

# Words of egomem.relations that do not read as "X is my <word>" (or read as the other side of one).
_BASE_EXCLUDE = {"owner", "pet", "child in their care", "niece or nephew", "aunt or uncle", "report",
                 "supervisee", "ward", "trainee", "employee", "employer", "ally", "companion", "parent",
                 "child", "sibling", "stepchild", "stepparent", "grandchild", "grandparent", "godchild",
                 "godparent", "parent-in-law", "child-in-law", "sibling-in-law", "half-sibling", "relative",
                 "spouse", "co-worker", "neighbor"}  # the last two: spelling twins of training words
_KIN = ("sister brother mother father cousin aunt uncle son daughter grandmother grandfather niece nephew "
        "wife husband partner girlfriend boyfriend").split()
_SPOUSES = {"wife", "husband", "partner", "girlfriend", "boyfriend"}
_SOCIAL_OF_KIN = ("friend,best friend,old friend,coworker,boss,neighbour,roommate,teacher,doctor,classmate,"
                  "teammate,mentor,landlord").split(",")
_FAMILY_OF_KIN = {  # whose partner or child reads naturally
    **{k: ["husband", "wife", "partner", "son", "daughter", "girlfriend", "boyfriend"]
       for k in ("sister", "brother", "cousin", "niece", "nephew")},
    **{k: ["husband", "partner"] for k in ("mother", "aunt", "grandmother")},
    **{k: ["wife", "partner"] for k in ("father", "uncle", "grandfather")},
    **{k: ["wife", "husband", "girlfriend", "boyfriend", "partner"] for k in ("son", "daughter")},
}
_FAMILY_OF_SPOUSE = "sister brother mother father cousin".split()
_SOCIAL = "best friend,friend,neighbour,boss,roommate,coworker,teacher,landlord,mentor".split(",")
_FAMILY_OF_SOCIAL = "husband wife partner son daughter sister brother girlfriend boyfriend".split()
_MODIFIED = {
    "old": "friend neighbour roommate classmate teacher boss teammate".split(),
    "childhood": "friend neighbour".split(),
    "former": "boss teacher coworker neighbour roommate landlord colleague".split(),
    "close": "friend cousin".split(),
    "family": "friend doctor".split(),
}
_SETTINGS = {
    "college": "friend roommate classmate".split(), "high school": "friend classmate".split(),
    "university": "friend".split(), "school": "friend".split(), "work": "friend".split(),
    "gym": "buddy".split(), "book club": "friend".split(), "choir": "friend".split(),
    "army": "buddy".split(), "summer camp": "friend".split(), "church": "friend".split(),
    "office": "mate".split(), "night class": "friend".split(),
}
_ACTIVITIES = {
    "partner": "tennis chess squash badminton bridge dance climbing sparring study running".split(),
    "buddy": "running hiking golf fishing cycling bowling poker gym drinking surfing".split(),
    "coach": "tennis running swimming boxing football basketball rowing rugby netball".split(),
    "teacher": "piano guitar violin singing drawing painting yoga dance art music drama".split(),
    "instructor": "yoga driving ski diving pilates karate flying".split(),
}
_PROFESSIONALS = ("dentist,hairdresser,accountant,vet,pharmacist,mechanic,plumber,dog walker,cleaner,gardener,"
                  "pastor,barber,tailor,physiotherapist,personal trainer,financial advisor,piano tuner,"
                  "math teacher,speech therapist,family lawyer,driving examiner,postman").split(",")
_EXTRA_KIN = ("great-aunt,great-uncle,great-grandmother,great-grandfather,second cousin,stepbrother,stepsister,"
              "foster mother,foster father,foster brother,foster sister,ex-wife,ex-husband,ex-girlfriend,"
              "ex-boyfriend,ex-partner,best man,maid of honour,younger sister,older sister,younger brother,"
              "older brother,twin sister,twin brother,little sister,big brother").split(",")

# ---------------------------------------------------------------------------- facts

_ART = re.compile(r"^[aeiou]", re.I)


def article(noun: str) -> str:
    """'an' before a vowel sound we can see (architect), else 'a'."""
    return "an" if _ART.match(noun) else "a"


@dataclass(frozen=True)
class FactKind:
    """A profile fact: how the store phrases it (`template`, "{}" = the value) and its values."""

    name: str
    template: str  # "lives in {}"; "{a}" is the value's article
    values: tuple[str, ...]

    def text(self, value: str) -> str:
        return self.template.format(value, a=article(value))


def _v(s: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in s.split(",") if x.strip())


FACT_KINDS: tuple[FactKind, ...] = (
    FactKind("city", "lives in {}", _v(
        "Lisbon,Porto,Madrid,Seville,Valencia,Barcelona,Paris,Lyon,Marseille,Bordeaux,Berlin,Hamburg,Munich,"
        "Cologne,Dresden,Vienna,Zurich,Geneva,Basel,Milan,Rome,Naples,Turin,Florence,Venice,Bologna,Athens,"
        "Prague,Warsaw,Krakow,Budapest,Oslo,Bergen,Stockholm,Gothenburg,Helsinki,Copenhagen,Dublin,Edinburgh,"
        "Glasgow,Leeds,Bristol,Cardiff,Belfast,Amsterdam,Rotterdam,Utrecht,Antwerp,Brussels,Ghent,Tallinn,Riga,"
        "Vilnius,Toronto,Montreal,Vancouver,Ottawa,Boston,Chicago,Denver,Seattle,Austin,Houston,Atlanta,Miami,"
        "Detroit,Nashville,Sydney,Melbourne,Brisbane,Auckland,Wellington,Tokyo,Osaka,Kyoto,Seoul,Busan,Taipei,"
        "Manila,Hanoi,Bangkok,Mumbai,Delhi,Cairo,Nairobi,Lagos,Accra,Dakar,Lima,Bogota,Santiago,Quito,Havana")),
    FactKind("job", "works as {a} {}", _v(
        "nurse,baker,carpenter,chef,pilot,architect,engineer,librarian,lawyer,farmer,firefighter,journalist,"
        "photographer,electrician,paramedic,surgeon,translator,designer,programmer,data analyst,florist,"
        "butcher,brewer,welder,potter,painter,musician,actor,dancer,zookeeper,geologist,chemist,biologist,"
        "astronomer,economist,historian,banker,cashier,waiter,bus driver,taxi driver,sailor,fisherman,miner,"
        "park ranger,lifeguard,locksmith,optician,midwife,social worker,police officer,judge,editor,"
        "novelist,poet,sculptor,jeweller,receptionist,tour guide,optometrist,radiologist,veterinarian")),
    FactKind("hobby", "enjoys {}", _v(
        "gardening,knitting,baking,birdwatching,photography,pottery,woodworking,calligraphy,origami,"
        "stargazing,camping,journaling,sewing,quilting,embroidery,crochet,model trains,jigsaw puzzles,"
        "crosswords,sudoku,beekeeping,geocaching,kayaking,rock climbing,sketching,scrapbooking,bonsai,"
        "magic tricks,foraging,metal detecting,board games,video games,karaoke,salsa dancing,"
        "ballroom dancing,canoeing,candle making,soap making,wood carving,bird feeding,fly fishing,"
        "sailing,snorkeling,roller skating,skateboarding,archery,fencing,juggling,podcasting,vlogging")),
    FactKind("pet", "has {a} {}", _v(
        "parrot,rabbit,hamster,goldfish,tortoise,guinea pig,ferret,budgie,canary,gecko,iguana,corn snake,"
        "chinchilla,cockatiel,hedgehog,pony,beagle,poodle,labrador,terrier,dachshund,collie,tabby cat,"
        "husky,spaniel,pug,greyhound,siamese cat,bearded dragon,axolotl,gerbil,sheepdog,dalmatian")),
    FactKind("sport", "plays {}", _v(
        "tennis,squash,golf,football,basketball,volleyball,badminton,rugby,cricket,baseball,hockey,netball,"
        "handball,table tennis,water polo,lacrosse,softball,pickleball,padel,darts,snooker,chess,"
        "ultimate frisbee,croquet,bridge,polo")),
    FactKind("food", "favourite food is {}", _v(
        "ramen,sushi,pizza,lasagna,paella,tacos,burritos,curry,pad thai,pho,dumplings,falafel,hummus,kebabs,"
        "moussaka,risotto,gnocchi,ravioli,pancakes,waffles,croissants,bagels,goulash,pierogi,borscht,"
        "jollof rice,fried chicken,fish and chips,meatballs,schnitzel,bratwurst,ratatouille,crepes,quiche,"
        "tapas,ceviche,empanadas,arepas,biryani,samosas,bibimbap,kimchi,tempura,udon,miso soup,spring rolls,"
        "lamb stew,chili,mac and cheese,cheesecake,tiramisu,apple pie,brownies,baklava,churros,gelato,"
        "pavlova,couscous,tagine,enchiladas,nachos,lentil soup,fondue,pretzels,porridge")),
    FactKind("instrument", "plays the {}", _v(
        "piano,violin,cello,guitar,drums,flute,clarinet,oboe,bassoon,trumpet,trombone,saxophone,harp,ukulele,"
        "banjo,mandolin,accordion,harmonica,viola,double bass,tuba,french horn,bagpipes,sitar,marimba,"
        "xylophone,organ,lute,recorder")),
    FactKind("school", "studied at {}", ()),  # values: `_schools`, split by prefix
    FactKind("language", "speaks {}", _v(
        "Spanish,French,German,Italian,Portuguese,Dutch,Swedish,Norwegian,Danish,Finnish,Polish,Czech,Greek,"
        "Turkish,Arabic,Hebrew,Hindi,Bengali,Urdu,Swahili,Japanese,Korean,Mandarin,Cantonese,Vietnamese,Thai,"
        "Russian,Ukrainian,Hungarian,Romanian,Welsh,Irish,Icelandic,Tagalog,Catalan,Basque")),
)
_SCHOOL_PREFIXES = _v(
    "Riverside,Oakridge,Hillcrest,Lakeview,Westfield,Northgate,Greenwood,Maplewood,Stonebridge,Brookfield,"
    "Fairview,Elmhurst,Kingsley,Ashford,Bayside,Cedarwood,Highfield,Millbrook,Pinecrest,Redwood,Southbank,"
    "Thornton,Willowdale,Clearwater,Eastwood,Foxley,Glenmore,Harrowgate,Ivybridge,Larchmont")
_SCHOOL_KINDS = ("College", "Academy", "University", "Institute")

PREFERENCES = _v(
    "jazz,rainy days,spicy food,early mornings,horror films,crowded buses,loud music,black coffee,green tea,"
    "long walks,cold weather,musicals,podcasts,poetry,opera,country music,heavy metal,reality shows,"
    "science fiction,mystery novels,road trips,museums,thunderstorms,snow,the beach,mushrooms,olives,"
    "cilantro,blue cheese,dark chocolate,licorice,strong coffee,hot weather,small talk,surprise parties,"
    "flying,sports cars,classical music,cartoons,documentaries,long queues,traffic jams,windy weather,"
    "crossword clues,folk music,hip hop,action movies,romantic comedies,fresh flowers,sunsets,garlic,"
    "peanut butter,pineapple,anchovies,marzipan,oysters,cold showers,late nights,loud parties,quiet cafes,"
    "old movies,fireworks,board meetings,phone calls,video calls,rollercoasters,autumn leaves,spring rain")
SUMMARY_TOPICS = _v(
    "planning a trip to the coast,a new job offer,fixing the kitchen sink,a birthday party,"
    "training for a marathon,moving house,a book they finished,learning to cook,a wedding next month,"
    "a noisy neighbour,a visit to the dentist,buying a new car,a family reunion,painting the bedroom,"
    "starting a vegetable patch,a concert last weekend,renovating the bathroom,a broken laptop,"
    "a holiday in the mountains,adopting a kitten,a school reunion,selling old furniture,a job interview,"
    "a sprained ankle,a new recipe,a camping weekend,the garden fence,a lost wallet,a promotion at work,"
    "planning a picnic,a flat tyre,a surprise visit,learning to swim,a new bicycle,a power cut,"
    "a charity run,a leaking roof,a yard sale,a volunteering day,a long train journey,a cooking class")

# ---------------------------------------------------------------------------- general instructions

_NUMBERS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
            "sixteen seventeen eighteen nineteen twenty").split()
_DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
_OPPOSITES = {"hot": "cold", "up": "down", "early": "late", "big": "small", "fast": "slow", "happy": "sad",
              "light": "dark", "open": "closed", "full": "empty", "loud": "quiet", "young": "old", "wet": "dry",
              "hard": "soft", "high": "low", "near": "far", "rich": "poor", "strong": "weak", "thick": "thin"}
_FIXED_QA = (
    ("How many days are in a week?", "Seven."), ("How many months are in a year?", "Twelve."),
    ("How many hours are in a day?", "Twenty-four."), ("How many legs does a spider have?", "Eight."),
    ("How many sides does a triangle have?", "Three."), ("What colour is grass?", "Green."),
    ("What colour is the sky on a clear day?", "Blue."), ("What do bees make?", "Honey."),
    ("What is frozen water called?", "Ice."), ("Which planet do we live on?", "Earth."),
    ("What gas do plants give off?", "Oxygen."), ("How many minutes are in an hour?", "Sixty."),
    ("Say something kind.", "You are doing great today."), ("Can you count to three?", "One, two, three."),
    ("What is the first letter of the alphabet?", "A."), ("What shape is a ball?", "Round."),
    ("Is the sun a star?", "Yes, the sun is a star."), ("What falls from clouds?", "Rain."),
    ("Give me a word that rhymes with moon.", "Spoon."), ("What do you call a baby cat?", "A kitten."),
    ("What do you call a baby dog?", "A puppy."), ("Which season comes after winter?", "Spring."),
    ("Which season comes after summer?", "Autumn."), ("How many wheels does a bicycle have?", "Two."),
    ("Tell me a short joke.", "I'd tell a chemistry joke, but no reaction."),
    ("What should I say to thank someone?", "Just say: thank you so much."),
    ("Wish me luck.", "Good luck! You will do well."), ("What is the boiling point of water?", "100 degrees Celsius."),
)


def general_pairs() -> tuple[tuple[str, str], ...]:
    """Level-0 (no memory) question/answer pairs: arithmetic, days, opposites and fixed facts."""
    out: list[tuple[str, str]] = []
    for a in range(1, 11):
        for b in range(1, 11):
            if a + b <= 20:
                out.append((f"What is {_NUMBERS[a]} plus {_NUMBERS[b]}?", f"{_NUMBERS[a + b].capitalize()}."))
            if a > b:
                out.append((f"What is {_NUMBERS[a]} minus {_NUMBERS[b]}?", f"{_NUMBERS[a - b].capitalize()}."))
    for i, d in enumerate(_DAYS):
        out.append((f"What day comes after {d}?", f"{_DAYS[(i + 1) % 7]}."))
        out.append((f"What day comes before {d}?", f"{_DAYS[(i - 1) % 7]}."))
    out += [(f"What is the opposite of {a}?", f"{b.capitalize()}.") for a, b in _OPPOSITES.items()]
    return tuple(out + list(_FIXED_QA))


# ---------------------------------------------------------------------------- the split


def words(text: str) -> tuple[str, ...]:
    """Lower-case word tokens ("sister's" -> "sister", "s"): what "occurs as a word" means here."""
    return tuple(re.findall(r"[a-z0-9]+", text.lower()))


def _ngrams(toks: tuple[str, ...], n_max: int) -> set[tuple[str, ...]]:
    return {toks[i:j] for i in range(len(toks)) for j in range(i + 1, min(len(toks), i + n_max) + 1)}


def hashed_out(pool: str, item: str) -> bool:
    """The fixed rule: sha256("<pool>:<item>") first 4 bytes mod HELDOUT_EVERY == 0."""
    h = hashlib.sha256(f"{pool}:{item}".encode()).digest()
    return int.from_bytes(h[:4], "big") % HELDOUT_EVERY == 0


def _first_names() -> list[str]:
    return sorted({o + v + e for o in _FIRST_ONSETS for v in _FIRST_VOWELS for e in _FIRST_ENDS
                   if 3 <= len(o + v + e) <= 8 and not (o[0] in "AEIOU" and len(v) > 1)})  # no "Alailin"


def _surnames() -> list[str]:
    return sorted({o + v + e for o in _SURNAME_ONSETS for v in _SURNAME_VOWELS for e in _SURNAME_ENDS
                   if e[0] not in "aeiou"})  # no "Biock", "Boett"


def _relations() -> list[str]:
    base = [w for w in base_relation_words() if w not in _BASE_EXCLUDE and not w.startswith("related")]
    out = set(base) | set(_EXTRA_KIN)
    for k in _KIN:
        ys = _SOCIAL_OF_KIN + (_FAMILY_OF_SPOUSE if k in _SPOUSES else _FAMILY_OF_KIN.get(k, []))
        out.update(f"{k}'s {y}" for y in ys if y != k)
    out.update(f"{s}'s {y}" for s in _SOCIAL for y in _FAMILY_OF_SOCIAL)
    out.update(f"{m} {n}" for m, ns in _MODIFIED.items() for n in ns)
    out.update(f"{s} {n}" for s, ns in _SETTINGS.items() for n in ns)
    out.update(f"{a} {role}" for role, acts in _ACTIVITIES.items() for a in acts)
    out.update(_PROFESSIONALS)
    return sorted(r for r in out if len(r) <= MAX_RELATION_CHARS)


def _schools(prefixes: Iterable[str]) -> tuple[str, ...]:
    return tuple(f"{p} {k}" for p in prefixes for k in _SCHOOL_KINDS)


@dataclass(frozen=True)
class Pools:
    """One split's share of every pool."""

    split: Split
    first_names: tuple[str, ...]
    surnames: tuple[str, ...]
    relations: tuple[str, ...]
    core_relations: tuple[str, ...]  # the common ones (drawn more often)
    facts: dict[str, tuple[str, ...]]  # FactKind.name -> values
    preferences: tuple[str, ...]
    summary_topics: tuple[str, ...]


@lru_cache(maxsize=1)
def _split_all() -> dict[str, dict[str, tuple[list[str], list[str]]]]:
    """pool -> (train items, held-out items), after the closure (module docstring)."""
    raw: dict[str, list[str]] = {
        "first_name": _first_names(), "surname": _surnames(), "relation": _relations(),
        "preference": list(PREFERENCES), "summary": list(SUMMARY_TOPICS),
        **{f"fact:{k.name}": list(k.values) for k in FACT_KINDS if k.values},
    }
    fixed = {w for q, a in general_pairs() for w in _ngrams(words(q + " " + a), 4)}
    # a name that is also a word of another pool is not a name we want (it would read as a fact)
    other = {t for p, items in raw.items() if p not in ("first_name", "surname") for i in items for t in words(i)}
    for p in ("first_name", "surname"):
        raw[p] = [n for n in raw[p] if n.lower() not in other and (n.lower(),) not in fixed]
    held = {p: {i for i in items if hashed_out(p, i) and words(i) not in fixed
                and not (p == "relation" and i in CORE_RELATIONS)} for p, items in raw.items()}
    while True:  # closure: a training item containing a held-out word or phrase is held out too
        held_grams = {words(i) for p in held for i in held[p]}
        moved = False
        for p, items in raw.items():
            for i in items:
                if i not in held[p] and _ngrams(words(i), 6) & held_grams:
                    held[p].add(i)
                    moved = True
        if not moved:
            break
    return {p: ([i for i in items if i not in held[p]], [i for i in items if i in held[p]]) for p, items in raw.items()}


@lru_cache(maxsize=2)
def pools(split: Split) -> Pools:
    """The items `split` may use (train and held-out share none)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    k = 0 if split == "train" else 1
    s = _split_all()
    pick = {p: tuple(v[k]) for p, v in s.items()}
    prefixes = [p for p in _SCHOOL_PREFIXES if hashed_out("school", p) == (split == "heldout")]
    facts = {kind.name: pick[f"fact:{kind.name}"] if kind.values else _schools(prefixes) for kind in FACT_KINDS}
    return Pools(split, pick["first_name"], pick["surname"], pick["relation"],
                 tuple(r for r in pick["relation"] if r in CORE_RELATIONS), facts, pick["preference"],
                 pick["summary"])


def vocabulary_sizes() -> dict[str, dict[str, int]]:
    """Pool sizes per split, e.g. {"relations": {"train": 620, "heldout": 150, "total": 770}, ...}."""
    tr, ho = pools("train"), pools("heldout")
    rows = {"first_names": (tr.first_names, ho.first_names), "surnames": (tr.surnames, ho.surnames),
            "relations": (tr.relations, ho.relations), "preferences": (tr.preferences, ho.preferences),
            "summary_topics": (tr.summary_topics, ho.summary_topics),
            **{f"fact:{k}": (tr.facts[k], ho.facts[k]) for k in tr.facts}}
    return {k: {"train": len(a), "heldout": len(b), "total": len(a) + len(b)} for k, (a, b) in rows.items()}


def fact_kind(name: str) -> FactKind:
    for k in FACT_KINDS:
        if k.name == name:
            return k
    raise KeyError(f"no fact kind {name!r}; known: {[k.name for k in FACT_KINDS]}")


_PARSE_ORDER = ("instrument", "job", "pet", "food", "school", "language", "city", "hobby", "sport")
_PATTERNS = tuple((n, re.compile("^" + re.escape(fact_kind(n).template).replace(r"\{a\}", "(?:a|an)")
                                 .replace(r"\{\}", "(.+)") + "$")) for n in _PARSE_ORDER)


def parse_fact(text: str) -> tuple[str, str] | None:
    """("city", "Lisbon") for "lives in Lisbon"; None for a fact no template makes."""
    for name, pat in _PATTERNS:
        m = pat.match(text)
        if m:
            return name, m.group(1)
    return None

"""A deterministic, realistic agent conversation for benchmarks: user turns, assistant text, tool calls and
tool results of up to a few thousand tokens, with five tool schemas."""

from __future__ import annotations

import json
import random
from typing import Any

_WORDS = [
    "the",
    "request",
    "failed",
    "because",
    "the",
    "upstream",
    "service",
    "returned",
    "an",
    "error",
    "after",
    "the",
    "timeout",
    "was",
    "reached",
    "and",
    "the",
    "retry",
    "budget",
    "ran",
    "out",
    "so",
    "we",
    "rolled",
    "back",
    "the",
    "deployment",
    "to",
    "version",
    "checked",
    "logs",
    "metrics",
    "latency",
    "p99",
    "database",
    "index",
    "migration",
    "cache",
    "invalidation",
    "customer",
    "invoice",
    "shipment",
    "warehouse",
    "order",
    "status",
    "pending",
    "approved",
    "rejected",
    "refund",
    "policy",
    "quarterly",
    "revenue",
    "forecast",
    "growth",
    "region",
    "europe",
    "asia",
    "america",
    "total",
    "average",
    "median",
    "percentile",
    "budget",
    "headcount",
    "hiring",
    "plan",
    "roadmap",
    "milestone",
    "release",
    "candidate",
    "regression",
]

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {
                    key: {"type": kind, "description": f"The {key.replace('_', ' ')}."} for key, kind in params
                },
                "required": [params[0][0]],
            },
        },
    }
    for name, description, params in [
        ("search_logs", "Search service logs in a time range.", [("query", "string"), ("hours", "integer")]),
        ("run_sql", "Run a read-only SQL query on the warehouse.", [("sql", "string"), ("limit", "integer")]),
        ("read_file", "Read a file from the repository.", [("path", "string"), ("max_bytes", "integer")]),
        ("http_get", "Fetch a URL from the internal API.", [("url", "string"), ("timeout_s", "number")]),
        ("create_ticket", "Open an incident ticket.", [("title", "string"), ("severity", "string")]),
    ]
]


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words)).capitalize() + "."


def _tool_result(rng: random.Random, size_words: int) -> str:
    kind = rng.randrange(3)
    if kind == 0:  # JSON rows
        rows = [
            {
                "id": rng.randrange(10**6),
                "status": rng.choice(_WORDS),
                "amount": round(rng.uniform(1, 9999), 2),
            }
            for _ in range(max(1, size_words // 9))
        ]
        return json.dumps({"rows": rows})
    if kind == 1:  # log lines
        return "\n".join(
            f"2026-11-{rng.randrange(1, 29):02d}T{rng.randrange(24):02d}:{rng.randrange(60):02d}:00Z "
            f"{rng.choice(['INFO', 'WARN', 'ERROR'])} {_sentence(rng, 10)}"
            for _ in range(max(1, size_words // 14))
        )
    lines = [f"def handler_{i}(event, context):\n    return {{'ok': {i % 2 == 0}}}" for i in range(size_words // 12)]
    return "```python\n" + "\n\n".join(lines) + "\n```"


def build(messages: int = 2000, seed: int = 7) -> list[dict[str, Any]]:
    """An agent conversation of exactly ``messages`` messages (system first; ends on a user or tool turn)."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = [{"role": "system", "content": "You are an on-call SRE assistant. " * 8}]
    call = 0
    while len(out) < messages:
        out.append({"role": "user", "content": _sentence(rng, rng.randrange(8, 60))})
        for _ in range(rng.randrange(0, 3)):
            tool = rng.choice(TOOLS)["function"]["name"]
            call += 1
            call_id = f"call_{call:06d}"
            out.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": tool, "arguments": json.dumps({"query": _sentence(rng, 6)})},
                        }
                    ],
                }
            )
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": _tool_result(rng, rng.randrange(30, 1000)),
                }
            )
        out.append({"role": "assistant", "content": _sentence(rng, rng.randrange(20, 160))})
    out = out[:messages]
    # End on a request: drop trailing assistant text, keep whole units.
    while out[-1]["role"] == "assistant":
        out.pop()
    return out


# --- conversations in other scripts -------------------------------------------------------------------------
# Word lists per script, written for the benchmark (common words of each language).
_LEXICON: dict[str, tuple[str, ...]] = {
    "fr": (
        "la",
        "requête",
        "a",
        "échoué",
        "parce",
        "que",
        "le",
        "service",
        "distant",
        "répondu",
        "erreur",
        "après",
        "délai",
        "dépassé",
        "nous",
        "avons",
        "annulé",
        "déploiement",
        "vérifié",
        "journaux",
        "métriques",
        "latence",
        "base",
        "données",
        "index",
        "migration",
        "cache",
        "client",
        "facture",
        "entrepôt",
        "commande",
        "état",
        "approuvé",
        "rejeté",
        "remboursement",
        "prévision",
        "croissance",
        "région",
        "moyenne",
        "être",
        "déjà",
        "très",
        "où",
        "ça",
        "reçu",
        "coût",
        "élevé",
        "équipe",
        "sécurité",
        "clé",
        "fenêtre",
        "noël",
    ),
    "de": (
        "die",
        "Anfrage",
        "ist",
        "fehlgeschlagen",
        "weil",
        "der",
        "Dienst",
        "nach",
        "Zeitüberschreitung",
        "geantwortet",
        "hat",
        "wir",
        "haben",
        "zurückgerollt",
        "geprüft",
        "Protokolle",
        "Größe",
        "Rückerstattung",
        "Lieferung",
        "Bestellung",
        "über",
        "für",
        "Schlüssel",
        "Prüfung",
        "Datenbank",
        "Übersicht",
        "Häufigkeit",
        "Kunden",
        "Umsatz",
        "Wachstum",
        "Straße",
        "Fußnote",
        "Bürokratie",
        "Größenordnung",
        "müssen",
        "könnten",
    ),
    "es": (
        "la",
        "solicitud",
        "falló",
        "porque",
        "el",
        "servicio",
        "devolvió",
        "después",
        "tiempo",
        "límite",
        "revisamos",
        "registros",
        "métricas",
        "migración",
        "índice",
        "pedido",
        "almacén",
        "reembolso",
        "año",
        "niño",
        "señal",
        "también",
        "así",
        "está",
        "según",
        "región",
        "crecimiento",
        "presupuesto",
        "mañana",
    ),
    "pl": (
        "żądanie",
        "nie",
        "powiodło",
        "się",
        "ponieważ",
        "usługa",
        "zwróciła",
        "błąd",
        "przekroczeniu",
        "limitu",
        "czasu",
        "sprawdziliśmy",
        "dzienniki",
        "wdrożenie",
        "zamówienie",
        "magazyn",
        "zwrot",
        "źródło",
        "łącze",
        "wzrost",
        "średnia",
        "będzie",
        "dziś",
        "gałąź",
        "pamięć",
    ),
    "vi": (
        "yêu",
        "cầu",
        "thất",
        "bại",
        "vì",
        "dịch",
        "vụ",
        "trả",
        "về",
        "lỗi",
        "sau",
        "khi",
        "hết",
        "thời",
        "gian",
        "chúng",
        "tôi",
        "đã",
        "kiểm",
        "tra",
        "nhật",
        "ký",
        "đơn",
        "hàng",
        "kho",
        "hoàn",
        "tiền",
        "khách",
        "doanh",
        "thu",
        "tăng",
        "trưởng",
        "khu",
        "vực",
        "trung",
        "bình",
        "ngân",
        "sách",
    ),
    "ru": (
        "запрос",
        "завершился",
        "ошибкой",
        "потому",
        "что",
        "сервис",
        "вернул",
        "после",
        "таймаута",
        "мы",
        "откатили",
        "развертывание",
        "проверили",
        "журналы",
        "метрики",
        "задержка",
        "база",
        "данных",
        "индекс",
        "миграция",
        "кэш",
        "клиент",
        "счёт",
        "склад",
        "заказ",
        "статус",
        "одобрен",
        "отклонён",
        "возврат",
        "прогноз",
        "рост",
        "регион",
        "среднее",
        "бюджет",
        "план",
        "выпуск",
        "регрессия",
        "нагрузка",
        "узел",
        "очередь",
        "сообщение",
        "пользователь",
        "настройка",
        "подключение",
        "хранилище",
        "версия",
    ),
    "uk": (
        "запит",
        "не",
        "вдався",
        "через",
        "помилку",
        "сервісу",
        "ми",
        "перевірили",
        "журнали",
        "замовлення",
        "їх",
        "ґанок",
        "є",
        "повернення",
        "зростання",
        "середнє",
        "бюджет",
    ),
    "el": (
        "το",
        "αίτημα",
        "απέτυχε",
        "επειδή",
        "η",
        "υπηρεσία",
        "επέστρεψε",
        "σφάλμα",
        "μετά",
        "το",
        "χρονικό",
        "όριο",
        "ελέγξαμε",
        "αρχεία",
        "καταγραφής",
        "μετρήσεις",
        "καθυστέρηση",
        "βάση",
        "δεδομένων",
        "ευρετήριο",
        "πελάτης",
        "τιμολόγιο",
        "αποθήκη",
        "παραγγελία",
        "κατάσταση",
        "εγκρίθηκε",
        "απορρίφθηκε",
        "επιστροφή",
        "πρόβλεψη",
        "ανάπτυξη",
        "περιοχή",
        "μέσος",
        "όρος",
        "προϋπολογισμός",
        "έκδοση",
        "ουρά",
        "μήνυμα",
    ),
    "ar": (
        "الطلب",
        "فشل",
        "لأن",
        "الخدمة",
        "أعادت",
        "خطأ",
        "بعد",
        "انتهاء",
        "المهلة",
        "قمنا",
        "بالتراجع",
        "عن",
        "النشر",
        "وتحققنا",
        "من",
        "السجلات",
        "المقاييس",
        "زمن",
        "الاستجابة",
        "قاعدة",
        "البيانات",
        "الفهرس",
        "الترحيل",
        "العميل",
        "الفاتورة",
        "المستودع",
        "الطلبية",
        "الحالة",
        "مقبول",
        "مرفوض",
        "استرداد",
        "التوقعات",
        "النمو",
        "المنطقة",
        "المتوسط",
        "الميزانية",
        "الإصدار",
        "المستخدم",
        "الإعدادات",
        "الاتصال",
    ),
    "hi": (
        "अनुरोध",
        "विफल",
        "हुआ",
        "क्योंकि",
        "सेवा",
        "ने",
        "त्रुटि",
        "लौटाई",
        "समय",
        "सीमा",
        "के",
        "बाद",
        "हमने",
        "परिनियोजन",
        "वापस",
        "लिया",
        "लॉग",
        "जाँचे",
        "मेट्रिक्स",
        "विलंब",
        "डेटाबेस",
        "सूचकांक",
        "ग्राहक",
        "चालान",
        "गोदाम",
        "ऑर्डर",
        "स्थिति",
        "स्वीकृत",
        "अस्वीकृत",
        "धनवापसी",
        "पूर्वानुमान",
        "वृद्धि",
        "क्षेत्र",
        "औसत",
        "बजट",
        "संस्करण",
        "उपयोगकर्ता",
        "सेटिंग्स",
        "कनेक्शन",
        "और",
        "में",
        "है",
        "यह",
        "कि",
    ),
    "zh": (
        "请求",
        "失败",
        "因为",
        "上游",
        "服务",
        "返回",
        "错误",
        "超时",
        "之后",
        "我们",
        "回滚",
        "部署",
        "检查",
        "日志",
        "指标",
        "延迟",
        "数据库",
        "索引",
        "迁移",
        "缓存",
        "失效",
        "客户",
        "发票",
        "仓库",
        "订单",
        "状态",
        "已批准",
        "已拒绝",
        "退款",
        "政策",
        "季度",
        "收入",
        "预测",
        "增长",
        "地区",
        "平均",
        "中位数",
        "预算",
        "招聘",
        "计划",
        "路线图",
        "里程碑",
        "发布",
        "候选",
        "回归",
        "用户",
        "配置",
        "连接",
        "存储",
        "版本",
        "的",
        "了",
        "在",
        "是",
        "和",
        "这个",
        "问题",
        "已经",
    ),
    "ja": (
        "リクエスト",
        "が",
        "失敗",
        "しました",
        "上流",
        "の",
        "サービス",
        "エラー",
        "を",
        "返し",
        "タイムアウト",
        "後",
        "に",
        "デプロイ",
        "ロールバック",
        "ログ",
        "確認",
        "メトリクス",
        "レイテンシ",
        "データベース",
        "インデックス",
        "移行",
        "キャッシュ",
        "顧客",
        "請求書",
        "倉庫",
        "注文",
        "状態",
        "承認",
        "却下",
        "返金",
        "予測",
        "成長",
        "地域",
        "平均",
        "予算",
        "計画",
        "リリース",
        "ユーザー",
        "設定",
        "接続",
        "は",
        "で",
        "ます",
        "から",
        "ため",
    ),
    "en": (
        "the",
        "request",
        "failed",
        "because",
        "upstream",
        "service",
        "returned",
        "an",
        "error",
        "after",
        "timeout",
        "we",
        "rolled",
        "back",
        "deployment",
        "checked",
        "logs",
        "metrics",
        "latency",
        "database",
        "index",
        "migration",
        "cache",
        "customer",
        "invoice",
        "warehouse",
        "order",
        "status",
        "refund",
    ),
}
_UNSPACED = frozenset({"zh", "ja"})
_STOPS = {"zh": "。", "ja": "。", "ar": ".", "hi": "।", "el": ".", "default": "."}
_COMMAS = {"zh": "，", "ja": "、", "ar": "،", "default": ","}

# Each workload: the languages its messages are written in (one per message, in turn at random).
SCRIPTS: dict[str, tuple[str, ...]] = {
    "latin": ("fr", "de", "es", "pl", "vi"),
    "cjk": ("zh", "ja"),
    "cyrillic": ("ru", "uk"),
    "arabic": ("ar",),
    "devanagari": ("hi",),
    "greek": ("el",),
    "code": ("en",),  # English prose; tool results are code, SQL and indented JSON
    "mixed": ("zh", "ru", "ja", "ar", "hi", "el"),  # the workload: six scripts in one chat
}


def _prose(rng: random.Random, lang: str, words: int) -> str:
    """A paragraph of ``words`` words in ``lang``: sentences with commas, numbers and now and then an English term."""
    lexicon = _LEXICON[lang]
    joiner = "" if lang in _UNSPACED else " "
    stop, comma = _STOPS.get(lang, _STOPS["default"]), _COMMAS.get(lang, _COMMAS["default"])
    sentences, left = [], words
    while left > 0:
        n = min(left, rng.randrange(5, 16))
        left -= n
        parts = []
        for i in range(n):
            roll = rng.random()
            if roll < 0.05:
                parts.append(str(rng.choice([rng.randrange(100), rng.randrange(10**6), round(rng.uniform(0, 100), 1)])))
            elif roll < 0.08:
                parts.append(rng.choice(["HTTP 503", "p99", "Redis", "PostgreSQL", "API", "v2.14.1", "CPU", "OOM"]))
            else:
                parts.append(rng.choice(lexicon))
            if i and i < n - 1 and rng.random() < 0.1:
                parts[-1] += comma
        sentence = joiner.join(parts)
        sentences.append(sentence[:1].upper() + sentence[1:] + stop)
    return joiner.join(sentences) if lang in _UNSPACED else " ".join(sentences)


def _word(rng: random.Random, lang: str) -> str:
    return rng.choice(_LEXICON[lang])


def _script_result(rng: random.Random, lang: str, size_words: int, code_heavy: bool) -> str:
    """A tool result in ``lang``: JSON rows (escaped to ASCII as ``json.dumps`` does by default, or not), log
    lines, code with comments, an SQL query with its rows."""
    kind = rng.randrange(2, 6) if code_heavy else rng.randrange(5)
    if kind in (0, 1):  # JSON rows
        rows = [
            {
                "id": rng.randrange(10**6),
                "name": _word(rng, lang) + " " + _word(rng, lang),
                "status": _word(rng, lang),
                "amount": round(rng.uniform(1, 9999), 2),
                "note": _prose(rng, lang, rng.randrange(3, 9)),
            }
            for _ in range(max(1, size_words // 12))
        ]
        return json.dumps({"rows": rows}, ensure_ascii=kind == 0)
    if kind == 2:  # log lines
        return "\n".join(
            f"2026-11-{rng.randrange(1, 29):02d}T{rng.randrange(24):02d}:{rng.randrange(60):02d}:00Z "
            f"{rng.choice(['INFO', 'WARN', 'ERROR'])} [{_word(rng, lang)}] {_prose(rng, lang, 9)}"
            for _ in range(max(1, size_words // 13))
        )
    if kind == 3:  # code with comments in the language
        blocks = [
            f"def handler_{i}(event, context):\n    # {_prose(rng, lang, 6)}\n"
            f'    if event.get("{_word(rng, lang)}") is None:\n'
            f"        return {{'ok': False, 'error': \"{_word(rng, lang)}\"}}\n"
            f"    return {{'ok': {i % 2 == 0}, 'total': {rng.randrange(10**4)}}}"
            for i in range(max(1, size_words // 18))
        ]
        return "```python\n" + "\n\n".join(blocks) + "\n```"
    if kind == 4:  # SQL and its rows
        table = f"orders_{rng.randrange(10)}"
        head = (
            f"SELECT id, status, amount FROM {table} WHERE status = '{_word(rng, lang)}' "
            f"AND region = '{_word(rng, lang)}' ORDER BY amount DESC LIMIT {rng.randrange(10, 500)};\n"
        )
        rows = [
            f"| {rng.randrange(10**6):>7} | {_word(rng, lang)} | {rng.uniform(1, 9999):>9.2f} |"
            for _ in range(max(1, size_words // 6))
        ]
        return head + "\n".join(rows)
    return json.dumps(  # indented JSON, as tools that pretty-print return it
        {"result": {_word(rng, lang): [rng.randrange(1000) for _ in range(4)] for _ in range(max(1, size_words // 8))}},
        ensure_ascii=False,
        indent=2,
    )


def build_script(script: str, messages: int = 2000, seed: int = 7) -> list[dict[str, Any]]:
    """:func:`build`'s agent conversation with its text in the languages of ``SCRIPTS[script]``."""
    rng = random.Random(seed)
    langs = SCRIPTS[script]
    code_heavy = script == "code"
    system = _prose(random.Random(seed + 1), langs[0], 40)
    out: list[dict[str, Any]] = [{"role": "system", "content": "You are an on-call SRE assistant. " + system}]
    call = 0
    while len(out) < messages:
        lang = rng.choice(langs)
        out.append({"role": "user", "content": _prose(rng, lang, rng.randrange(8, 60))})
        for _ in range(rng.randrange(0, 3)):
            tool = rng.choice(TOOLS)["function"]["name"]
            call += 1
            call_id = f"call_{call:06d}"
            arguments = json.dumps({"query": _prose(rng, lang, 5)}, ensure_ascii=rng.random() < 0.5)
            out.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": call_id, "type": "function", "function": {"name": tool, "arguments": arguments}}
                    ],
                }
            )
            # Smaller than build()'s results: text in these scripts takes two to five times the tokens.
            content = _script_result(rng, lang, rng.randrange(20, 400), code_heavy)
            out.append({"role": "tool", "tool_call_id": call_id, "content": content})
        out.append({"role": "assistant", "content": _prose(rng, lang, rng.randrange(20, 160))})
    out = out[:messages]
    while out[-1]["role"] == "assistant":
        out.pop()
    return out


def mistral_call_ids(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with every tool-call id made 9 letters and digits (``call_000042`` -> ``c00000042``).

    Mistral models take only such ids (servers keep the last 9 characters of a longer id, and ``ll_000042`` is
    refused for its underscore), so an app serving one holds ids like these. Messages without ids are shared
    with the input, the others are new dicts; the input is not changed.
    """

    def short(call_id: str) -> str:
        return "c" + call_id.rsplit("_", 1)[-1].zfill(8)[-8:]

    out: list[dict[str, Any]] = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [{**call, "id": short(call["id"])} for call in message["tool_calls"]]
            message = {**message, "tool_calls": calls}
        elif message.get("tool_call_id"):
            message = {**message, "tool_call_id": short(message["tool_call_id"])}
        out.append(message)
    return out
